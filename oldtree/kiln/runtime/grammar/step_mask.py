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

``start`` fills a step's rows in the background instead, on one filler thread, and ``PendingMask.wait``
gives the device mask: the overlapped engine starts step N+1's fill as soon as step N's tokens are
accepted and draws N+1's tokens only at its next step, so the fill runs beside the host's other work
(the step's events, the next schedule) rather than before the draw. xgrammar fills outside the GIL;
the filler thread tells ``start`` when it reaches that call, so the caller's Python work cannot hold
the GIL between the thread and the fill (a waiting thread would otherwise get it only at Python's
switch interval, 5 ms, long after the fill was wanted). A few rows are filled on the calling thread
all the same (``BACKGROUND_MIN_ROWS``): the handoff costs more than it hides.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import torch

from kiln.kernels.bitmask import ALL_ALLOWED, allocate_bitmask

from .matcher import GrammarState


# Fewest constrained rows worth the filler thread. Measured on a 2-core CPU with a JSON schema mid-string
# (2026-12-07): one row fills in ~27 us and the handoff costs ~60 us more than filling in place; 64 rows
# fill in ~1.5 ms, of which ~1.3 ms ran beside the caller's Python work.
BACKGROUND_MIN_ROWS = 4


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
        pending = self.start(states, background=False)
        return None if pending is None else pending.wait()

    def start(self, states: Sequence[GrammarState | None], background: bool = True) -> "PendingMask | None":
        """``fill``'s mask, filled on the filler thread (``background``, for ``BACKGROUND_MIN_ROWS`` or
        more constrained rows) while the caller goes on; ``wait`` gives it. The states must not move
        until then, and no other fill may start."""
        rows = [row for row, state in enumerate(states) if state is not None]
        if not rows:
            return None
        buffer = self._next_buffer(len(states))
        filled = set(rows)
        for row in buffer.grammar_rows - filled:
            buffer.mask[row].fill_(ALL_ALLOWED)
        buffer.grammar_rows = filled
        constrained = [states[row] for row in rows]
        if not background or len(rows) < BACKGROUND_MIN_ROWS:
            GrammarState.fill_bitmasks(constrained, buffer.mask, rows)
            return PendingMask(self, buffer, len(states), None)
        reached_fill = threading.Event()

        def fill_rows() -> None:
            reached_fill.set()
            GrammarState.fill_bitmasks(constrained, buffer.mask, rows)

        work = _filler().submit(fill_rows)
        reached_fill.wait()
        return PendingMask(self, buffer, len(states), work)

    def upload(self, buffer: _HostBuffer, batch: int) -> torch.Tensor:
        """``buffer``'s first ``batch`` rows, once filled, on the device (the host rows themselves on a CPU)."""
        host = buffer.mask[:batch]
        if not self._on_gpu:
            return host
        device_mask = self._device_buffer()[:batch]
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


class PendingMask:
    """A step's mask being filled (``StepMasks.start``); ``wait`` gives it on the device."""

    def __init__(self, masks: StepMasks, buffer: _HostBuffer, batch: int, work: Future | None) -> None:
        self._masks, self._buffer, self._batch, self._work = masks, buffer, batch, work

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.result()  # the fill's own error (a terminated state), raised here
        return self._masks.upload(self._buffer, self._batch)


_FILLER: ThreadPoolExecutor | None = None


def _filler() -> ThreadPoolExecutor:
    """The process's one filler thread (made on first use; xgrammar's own pool fills the rows)."""
    global _FILLER
    if _FILLER is None:
        _FILLER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-grammar-mask")
    return _FILLER
