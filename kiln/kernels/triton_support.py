"""What every Triton launcher shares: input checks, the interpreter switch, dtype sets, device facts,
programmatic dependent launch, and the semaphore counters of kernels whose last program finishes
the work of the others.

Launchers check their tensors with ``require`` (raising ``ValueError`` that names the kernel and the
input) because a wrong stride or dtype in a Triton kernel gives silently wrong numbers, not an error.
Checkers (which decide at compile time whether the Triton kernel takes a node) use the IR-side sets.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from typing import Callable, Iterator

import torch
import triton
import triton.language as tl
import triton.language.extra.cuda  # noqa: F401  (tl.extra.cuda: grid dependency control)

from kiln.ir.types import DType

# Triton reads TRITON_INTERPRET when a kernel is decorated, which is when this package is imported, so
# reading it once here tells launchers which of the two worlds their kernels live in: the interpreter
# (CPU tensors, numpy semantics) or the GPU (CUDA tensors, compiled code).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _interpreter_scalar_index_shim() -> None:
    """Lets the interpreter use loaded scalars as loop bounds under NumPy >= 2.4.

    Triton 3.6's interpreter holds a scalar as a one-element array and converts it for ``range``
    with ``int(array)``, which NumPy 2.4 turned from a deprecation into a TypeError ("only
    0-dimensional arrays can be converted to Python scalars"). Every kernel here loops to a bound
    loaded from memory (a sequence's length), so under the interpreter the conversion is replaced by
    one that takes the array's single element. Compiled kernels are untouched.
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "kiln_shim", False):
        return

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor.kiln_shim = True
    interpreter._patch_lang_tensor = patch_lang_tensor


if INTERPRET:
    _interpreter_scalar_index_shim()


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
IR_FLOATS = (DType.f32, DType.f16, DType.bf16)
IR_INDEXES = (DType.i32, DType.i64)


def dot_in_f32(dtype: torch.dtype) -> bool:
    """Whether the attention kernels take their matrix products on f32 copies of the operands: for
    f32 inputs (in IEEE f32, not TF32), and always under the interpreter, which multiplies the raw bit
    patterns of bf16 operands instead of their values."""
    return dtype == torch.float32 or INTERPRET


def require(cond: bool, kernel: str, message: Callable[[], str]) -> None:
    # The message is built only on failure: launchers run on every step, and formatting shapes and
    # dtypes eagerly costs more host time than launching the kernel.
    if not cond:
        raise ValueError(f"{kernel}: {message()}")


def require_float(kernel: str, name: str, t: torch.Tensor) -> None:
    require(t.dtype in FLOAT_DTYPES, kernel, lambda: f"{name} must be f32, f16 or bf16, got {t.dtype}")


def require_index(kernel: str, name: str, t: torch.Tensor, rank: int = 1) -> None:
    require(t.dtype in INDEX_DTYPES, kernel, lambda: f"{name} must be int32 or int64, got {t.dtype}")
    require(t.dim() == rank, kernel, lambda: f"{name} must have rank {rank}, got shape {tuple(t.shape)}")
    require(t.stride(-1) == 1, kernel, lambda: f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def require_unit_last_stride(kernel: str, name: str, t: torch.Tensor) -> None:
    # Kernels index rows through strides but read each row as one contiguous run.
    require(t.stride(-1) == 1 or t.shape[-1] == 1, kernel,
            lambda: f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def require_device(kernel: str, *tensors: torch.Tensor) -> None:
    """Compiled kernels need CUDA tensors on one device; the interpreter needs CPU tensors."""
    devices = {t.device for t in tensors}
    require(len(devices) == 1, kernel, lambda: f"inputs are on several devices: {sorted(map(str, devices))}")
    device = devices.pop()
    if INTERPRET:
        require(device.type == "cpu", kernel,
                lambda: f"under TRITON_INTERPRET=1 inputs must be CPU tensors, got {device}")
    else:
        require(device.type == "cuda", kernel, lambda: f"inputs must be CUDA tensors, got {device}")


@functools.lru_cache(maxsize=None)
def multiprocessor_count(device_index: int) -> int:
    """How many programs run at once, roughly: the SM count on the GPU; a small fixed number when
    interpreting (the split heuristics then still produce several splits on small test inputs)."""
    if INTERPRET:
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def device_capability(t: torch.Tensor) -> tuple[int, int]:
    """A CUDA tensor's GPU's compute capability (cached: launchers ask on every call)."""
    return _capability(t.device.index if t.device.index is not None else torch.cuda.current_device())


def sm_count(t: torch.Tensor) -> int:
    if t.device.type != "cuda":
        return multiprocessor_count(0)
    return multiprocessor_count(t.device.index if t.device.index is not None else torch.cuda.current_device())


# Programmatic dependent launch (Hopper and later): a kernel launched with it may start while the
# kernel before it in the stream is still running, once every program of that kernel has signalled
# (``griddepcontrol.launch_dependents``); it then waits (``griddepcontrol.wait``) until that kernel
# has finished and its writes are visible. Decode steps of small models are chains of ~200 kernels of
# a few microseconds each, where the gap between one kernel's end and the next one's start is a large
# share of the step; with PDL the next kernel is already resident when the previous one ends.
# ``KernelConfig.pdl`` turns it off (to measure it, or to rule it out).


@functools.lru_cache(maxsize=None)
def _pdl_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_launch(t: torch.Tensor, enabled: bool) -> dict[str, bool]:
    """Launch options for a kernel that starts with ``await_previous_kernel(PDL)``: PDL on when
    ``enabled`` (the kernel config's ``pdl``) for CUDA tensors of a Hopper or later GPU, off under the
    interpreter and elsewhere."""
    if not enabled or INTERPRET or t.device.type != "cuda":
        return {"PDL": False}
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return {"PDL": True, "launch_pdl": True} if _pdl_capable(index) else {"PDL": False}


@triton.jit
def await_previous_kernel(PDL: tl.constexpr):
    """Called by a PDL-launched kernel before it touches memory that kernels before it write: waits
    until the kernel before it has finished (so its outputs are complete and nothing it still reads
    gets overwritten), then lets the kernel after it launch early in turn. Reads of what no kernel of
    the step writes (weights, constant tables, the step's inputs, which are copied in before its
    first kernel starts) may come before it, and then overlap the previous kernel's tail."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def pow2(n: int, least: int = 1) -> int:
    """The smallest power of two >= max(n, least): Triton block shapes must be powers of two."""
    return max(triton.next_power_of_2(max(n, 1)), least)


# The fewest counters allocated: 64 KiB covers 16384 of them (decode attention takes one per
# sequence and KV head, argmax one per row), more than any decode graph captures, so in practice the
# buffer never grows after its first use.
MIN_COUNTERS = 1 << 14

# The counter buffer of each device. Outgrown buffers are retired, never freed: a graph captured
# before the growth still reads and resets the old one on every replay.
_counters: dict[tuple[torch.device, bool], torch.Tensor] = {}  # by device and side lane
_on_side_lane = contextvars.ContextVar("kiln_on_side_lane", default=False)
_retired: list[torch.Tensor] = []


def semaphore_counters(device: torch.device, needed: int) -> torch.Tensor:
    """The device's zeroed int32 counter buffer, with at least ``needed`` entries.

    Kernels that split a unit of work (a sequence's KV group in decode attention, a row in argmax)
    over several programs give each unit a counter here: every program takes a ticket from it, the
    one that draws the last ticket finishes the unit and puts the counter back to zero. So every
    launch leaves the buffer all zeros, and the buffer lives as long as the process so that captured
    CUDA graphs can bake in its address.

    All such kernels of a stream share one buffer, unit ``i`` of every kernel using entry ``i``. That
    is safe because a stream's launches run one after another (a kernel's programs all finish, the
    counters back at zero, before the next kernel's start); kernels launched inside ``side_lane()``
    (the step's side stream, which runs beside the main one) take a buffer of their own, so the two
    streams never count on each other's tickets. The buffer never grows inside a CUDA-graph capture
    (growing there raises): it is sized generously, and the engine runs every captured shape eagerly
    first.
    """
    key = (device, _on_side_lane.get())
    counters = _counters.get(key)
    if counters is None or counters.numel() < needed:
        # Allocated inside a capture, the zeros would only be written when the graph replays (and
        # from the graph's private pool), so an eager launch in between would count from garbage.
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"a kernel needs {needed} semaphore counters on {device} during a CUDA-graph "
                               "capture; run the captured shape eagerly once before capturing it")
        if counters is not None:
            _retired.append(counters)
        counters = torch.zeros(pow2(needed, MIN_COUNTERS), dtype=torch.int32, device=device)
        _counters[key] = counters
    return counters


@contextlib.contextmanager
def side_lane() -> Iterator[None]:
    """Kernels launched inside take the side stream's semaphore counters (``semaphore_counters``)."""
    token = _on_side_lane.set(True)
    try:
        yield
    finally:
        _on_side_lane.reset(token)


@triton.jit
def tanh(x):
    # Triton's core language has no tanh. 1 - 2 / (e^{2x} + 1) saturates to +-1 without NaN at both
    # ends (e^{2x} -> inf gives 1, -> 0 gives -1).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
