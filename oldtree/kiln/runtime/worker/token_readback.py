"""Reading a launched decode step's greedy tokens back to the host without draining the stream.

``.tolist()`` on a device tensor copies on the current stream, behind everything queued so far: with
step N+1 already launched (overlapped scheduling), reading step N's tokens that way also waits for
N+1, and the host then prepares N+2 while the GPU sits idle. So as soon as step N is launched its
tokens are copied into a pinned host buffer and an event is recorded behind the copy; reading waits
for that event only, i.e. for step N. A decode graph's argmax writes its tokens to pinned host
memory itself (``mirror``): then only the event is recorded, and nothing is queued between that
graph and the next.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scheduler.batch import StepLists


@dataclass(frozen=True)
class InflightStep:
    """A launched decode step whose tokens the host has not read yet. ``tokens`` is the step's
    device output (valid until the next step is launched: the next step reads its input ids from
    it); ``host`` fills in when ``ready`` completes. ``by_argmax``: the tokens are the decode graph's
    argmax of every row (nothing to mask or sample), so its follow-up steps', which run the same
    requests, are too."""

    lists: StepLists
    tokens: torch.Tensor
    host: torch.Tensor
    ready: torch.cuda.Event | None
    by_argmax: bool = False

    def host_tokens(self) -> torch.Tensor:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host


class TokenReadback:
    def __init__(self, max_batch: int, device: torch.device) -> None:
        self._on_gpu = device.type == "cuda"
        self._max_batch = max_batch
        # Two buffers of each token dtype (a graph's argmax gives int32 ids, the sampler int64), used
        # in turn: step N's is read while step N+1's copy may still be pending. Matching the dtype
        # keeps the copy one transfer, with no conversion kernel on the device before it.
        self._buffers: dict[torch.dtype, list[torch.Tensor]] = {}
        self._turn = 0

    def launch(self, lists: StepLists, tokens: torch.Tensor, mirror: torch.Tensor | None = None,
               by_argmax: bool = False) -> InflightStep:
        """Starts copying ``tokens`` (the step's device output) to the host, behind the step; or,
        given ``mirror`` (host memory the step itself writes the same tokens to), only marks where
        they are complete."""
        if mirror is not None:
            return InflightStep(lists, tokens, mirror, self._mark(), by_argmax)
        if tokens.dtype not in self._buffers:
            self._buffers[tokens.dtype] = [torch.empty(self._max_batch, dtype=tokens.dtype, pin_memory=self._on_gpu)
                                           for _ in range(2)]
        host = self._buffers[tokens.dtype][self._turn][:tokens.numel()]
        self._turn ^= 1
        host.copy_(tokens, non_blocking=self._on_gpu)
        return InflightStep(lists, tokens, host, self._mark(), by_argmax)

    def _mark(self) -> torch.cuda.Event | None:
        """An event behind everything queued so far on the current stream (None on a CPU)."""
        if not self._on_gpu:
            return None
        ready = torch.cuda.Event()
        ready.record()
        return ready
