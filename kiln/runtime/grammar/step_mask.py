"""``StepMasks``: the packed grammar bitmask of each step, in buffers reused from step to step.

A step's rows are its sampled requests; a row with a ``GrammarState`` gets its allowed tokens (all
constrained rows filled in one ``GrammarState.fill_bitmasks`` call), every other row allows every
token. Allocating a mask each step costs a pinned host allocation and a device allocation per step;
here the host buffer is kept (grown when a larger batch comes) and so is the device buffer the mask
is copied to, in one non-blocking copy per step.

On CUDA the host buffers are pinned, so the copy is truly asynchronous, and there are two of them,
used in turn: while step N's copy may still be pending, step N+1 fills the other one, and a buffer
is written again only after the event recorded behind its copy has passed. The device buffer needs
no such care: copies into it and the kernels reading it are ordered on the one stream.

A row keeps its last mask until rewritten, so rows that a constrained request held in a buffer's
previous use and an unconstrained one holds now are set back to all-allowed (and only those).
"""

from __future__ import annotations

from typing import Sequence

import torch

from kiln.kernels.bitmask import ALL_ALLOWED, allocate_bitmask

from .matcher import GrammarState


class _HostBuffer:
    """One host bitmask, the rows its last use filled from a grammar, and the event behind its copy."""

    def __init__(self, rows: int, vocab_size: int, pinned: bool) -> None:
        self.mask = allocate_bitmask(rows, vocab_size, pin_memory=pinned)
        self.grammar_rows: set[int] = set()
        self.copied: torch.cuda.Event | None = None


class StepMasks:
    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._on_gpu = self.device.type == "cuda"
        self._host: list[_HostBuffer] = []
        self._turn = 0
        self._device_mask: torch.Tensor | None = None

    def fill(self, states: Sequence[GrammarState | None]) -> torch.Tensor | None:
        """The bitmask ``[len(states), ceil(V / 32)]`` on the device, row i from ``states[i]`` (None:
        every token allowed); None when no row is constrained. Valid until the next ``fill`` (on CUDA:
        for the kernels queued on the current stream before it)."""
        rows = [row for row, state in enumerate(states) if state is not None]
        if not rows:
            return None
        buffer = self._next_buffer(len(states))
        filled = set(rows)
        for row in buffer.grammar_rows - filled:
            buffer.mask[row].fill_(ALL_ALLOWED)
        buffer.grammar_rows = filled
        GrammarState.fill_bitmasks([states[row] for row in rows], buffer.mask, rows)
        host = buffer.mask[:len(states)]
        if not self._on_gpu:
            return host
        device_mask = self._device_buffer()[:len(states)]
        device_mask.copy_(host, non_blocking=True)
        buffer.copied = torch.cuda.Event()
        buffer.copied.record()
        return device_mask

    def _next_buffer(self, batch: int) -> _HostBuffer:
        """The host buffer to fill this step (large enough for ``batch`` rows), free to write."""
        if not self._host or self._host[0].mask.shape[0] < batch:
            # Grown to the next power of two, so a slowly growing batch reallocates only a few times.
            rows = 1 << (batch - 1).bit_length()
            for buffer in self._host:
                if buffer.copied is not None:
                    buffer.copied.synchronize()  # a pending copy still reads the old buffer
            self._host = [_HostBuffer(rows, self.vocab_size, self._on_gpu) for _ in range(2 if self._on_gpu else 1)]
            self._device_mask = None
        buffer = self._host[self._turn]
        self._turn = (self._turn + 1) % len(self._host)
        if buffer.copied is not None:
            buffer.copied.synchronize()  # its last copy (two steps ago) is long done: this rarely waits
            buffer.copied = None
        return buffer

    def _device_buffer(self) -> torch.Tensor:
        if self._device_mask is None:
            self._device_mask = torch.empty_like(self._host[0].mask, device=self.device)
        return self._device_mask
