"""Elementwise kernels: add, mul, silu, silu_mul (the fused gate of a gated MLP), cast.

silu_mul and add have a Triton kernel (one, rows by column blocks, launched with PDL): add for the
residual adds no GEMM takes (Qwen2-MoE's experts take the shared expert's output as their residual,
leaving the layer's add), where a torch launch between two PDL kernels costs both their overlaps.
The others are fused away by the compiler or single torch calls that already run at copy bandwidth.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kiln.ir.types import TensorType

from .config import DEFAULTS, KernelConfig
from .registry import register_impl
from .triton_support import (IR_FLOATS, await_previous_kernel, pdl_launch, pow2, require, require_device, require_float,
                             require_unit_last_stride)


def ref_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b


def ref_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a * b


def ref_silu(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x)


def ref_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def ref_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype)


def _add(a, b, *, out):
    torch.add(a, b, out=out)


def _mul(a, b, *, out):
    torch.mul(a, b, out=out)


def _silu(x, *, out):
    out.copy_(ref_silu(x))


def _silu_mul(gate, up, *, out):
    out.copy_(ref_silu_mul(gate, up))


def _cast(x, *, out, dtype):
    out.copy_(x)


register_impl("add", "torch", _add)
register_impl("mul", "torch", _mul)
register_impl("silu", "torch", _silu)
register_impl("silu_mul", "torch", _silu_mul)
register_impl("cast", "torch", _cast)


# --- Triton -----------------------------------------------------------------------------------------


# What the row kernel computes from its two operands.
_SILU_MUL = tl.constexpr(0)
_ADD = tl.constexpr(1)


@triton.jit
def _rows_kernel(a_ptr, b_ptr, out_ptr, width, a_st, b_st, o_st, OP: tl.constexpr, BLOCK: tl.constexpr,
                 PDL: tl.constexpr):
    # Program (row, j) computes columns j*BLOCK .. +BLOCK of one row. For silu_mul, gate and up are
    # usually the two halves of one [T, 2I] GEMM output (views from split), hence their own row strides.
    await_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    a = tl.load(a_ptr + row * a_st + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row * b_st + cols, mask=mask, other=0.0).to(tl.float32)
    if OP == _SILU_MUL:
        # silu(gate) is rounded to the dtype before the multiply, as the reference's two torch ops do.
        a = (a / (1.0 + tl.exp(-a))).to(out_ptr.dtype.element_ty).to(tl.float32)
        result = a * b
    else:
        result = a + b
    tl.store(out_ptr + row * o_st + cols, result.to(out_ptr.dtype.element_ty), mask=mask)


def _launch_rows(kernel: str, op: tl.constexpr, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, block: int,
                 config: KernelConfig) -> None:
    names = ("gate", "up") if op == _SILU_MUL else ("a", "b")
    for name, t in zip(names + ("out",), (a, b, out)):
        require(t.dim() == 2, kernel, lambda: f"{name} must be [T, I], got {tuple(t.shape)}")
        require(t.shape == a.shape and t.dtype == a.dtype, kernel,
                lambda: f"{name} {tuple(t.shape)} {t.dtype} must match {names[0]} {tuple(a.shape)} {a.dtype}")
        require_unit_last_stride(kernel, name, t)
    require_float(kernel, names[0], a)
    require_device(kernel, a, b, out)
    rows, width = a.shape
    if rows == 0 or width == 0:
        return
    block = min(block, pow2(width))
    _rows_kernel[(rows, triton.cdiv(width, block))](
        a, b, out, width, a.stride(0), b.stride(0), out.stride(0), OP=op, BLOCK=block, num_warps=4,
        **pdl_launch(a, config.pdl))


def triton_silu_mul(gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor,
                    config: KernelConfig = DEFAULTS) -> None:
    _launch_rows("triton.silu_mul", _SILU_MUL, gate, up, out, config.silu_mul_block, config)


def triton_add(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor, config: KernelConfig = DEFAULTS) -> None:
    _launch_rows("triton.add", _ADD, a, b, out, config.add_block, config)


def _rows_checker(types: Sequence[TensorType], attrs: Mapping[str, Any]) -> bool:
    # Both operands one float dtype and one [T, I] shape: a broadcast or mixed add stays on torch.
    a, b = types
    return a.dtype in IR_FLOATS and a.rank == 2 and b == a


register_impl("silu_mul", "triton", triton_silu_mul, checker=_rows_checker, priority=10, wants_config=True)
register_impl("add", "triton", triton_add, checker=_rows_checker, priority=10, wants_config=True)
