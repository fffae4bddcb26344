"""CUDA graph capture with Python's garbage collector held off.

A capture fails when something else calls into CUDA mid-capture in a way the capture forbids
(``cudaErrorStreamCaptureInvalidated``). Python's cyclic collector can run at any allocation, and
an engine dropped earlier in the process is a cycle that it may free right then, destroying that
engine's CUDA graphs, events and buffers inside this capture: seen on an H100 when a benchmark
built a second engine after dropping the first. torch no longer collects on entering a capture
(``torch.compiler.config.force_cudagraph_gc``), so the collector is paused for each capture
instead; what it would have freed is freed at its next run, outside the capture.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator

import torch

# Eager runs of a step before its capture: the first compiles or loads every Triton kernel at the
# step's sizes, autotunes, sizes shared scratch (the argmax's counters) and lets cuBLAS pick its
# algorithms, all of which a capture forbids; a second run would find nothing left to do and only
# lengthen start-up (each is a host-bound eager step: ~20 ms for SmolLM2's 30 layers).
WARMUP_RUNS = 1


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside, as it was outside."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextmanager
def capture_graph(graph: torch.cuda.CUDAGraph, pool) -> Iterator[None]:
    """``torch.cuda.graph(graph, pool=pool)`` with the collector paused for the capture."""
    with collector_paused(), torch.cuda.graph(graph, pool=pool):
        yield
