"""What every Triton launcher shares: input checks, the interpreter switch, dtype sets, device facts.

Launchers check their tensors with ``require`` (raising ``ValueError`` that names the kernel and the
input) because a wrong stride or dtype in a Triton kernel gives silently wrong numbers, not an error.
Checkers (which decide at compile time whether the Triton kernel takes a node) use the IR-side sets.
"""

from __future__ import annotations

import functools
import os
from typing import Callable

import torch
import triton
import triton.language as tl

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


def sm_count(t: torch.Tensor) -> int:
    if t.device.type != "cuda":
        return multiprocessor_count(0)
    return multiprocessor_count(t.device.index if t.device.index is not None else torch.cuda.current_device())


def pow2(n: int, least: int = 1) -> int:
    """The smallest power of two >= max(n, least): Triton block shapes must be powers of two."""
    return max(triton.next_power_of_2(max(n, 1)), least)


@triton.jit
def tanh(x):
    # Triton's core language has no tanh. 1 - 2 / (e^{2x} + 1) saturates to +-1 without NaN at both
    # ends (e^{2x} -> inf gives 1, -> 0 gives -1).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
