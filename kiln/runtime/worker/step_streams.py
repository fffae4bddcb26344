"""The step's side stream: where the program launches the ops that may overlap the main stream's.

A step program (``kiln/compiler/codegen/program.py``) launches each side-stream op (``OpDef.side_stream``:
a LoRA hook's shrink) inside ``with streams.side():`` and puts ``streams.join()`` before the first op
that reads what one made. On a CUDA device the side stream first waits for everything launched on
the current (main) stream so far, so the op sees its inputs, then runs beside whatever the main
stream launches next (the hook's GEMM) until the join makes the main stream wait for it. The memory
plan keeps the op's operands alive until that join. Side kernels take semaphore counters of their
own (``triton_support.side_lane``). Under CUDA-graph capture the same calls fork the side stream
from the capturing stream and join it back, so the graph holds the two branches.

Elsewhere (CPU, the interpreter) or with ``KernelConfig.side_stream`` off, both calls do nothing and
the ops run in program order on one stream.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from kiln.kernels.triton_support import side_lane


class StepStreams:
    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self._device = device
        self._side = torch.cuda.Stream(device) if enabled and device.type == "cuda" else None
        self._launched = False  # side work not yet joined

    @contextlib.contextmanager
    def side(self) -> Iterator[None]:
        if self._side is None:
            yield
            return
        self._side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._side), side_lane():
            yield
        self._launched = True

    def join(self) -> None:
        """The main stream waits for everything launched on the side stream."""
        if self._side is not None and self._launched:
            torch.cuda.current_stream(self._device).wait_stream(self._side)
            self._launched = False
