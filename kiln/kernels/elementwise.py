"""Elementwise kernels: add, mul, silu, silu_mul (the fused gate of a gated MLP), cast.

Only silu_mul has a Triton kernel: the others are either fused away by the compiler or single torch
calls that already run at copy bandwidth.
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


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, width, g_st, u_st, o_st, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # Program (row, j) computes columns j*BLOCK .. +BLOCK of one row. gate and up are usually the two
    # halves of one [T, 2I] GEMM output (views from split), hence their own row strides.
    await_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    g = tl.load(gate_ptr + row * g_st + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * u_st + cols, mask=mask, other=0.0).to(tl.float32)
    # silu(gate) is rounded to the dtype before the multiply, as the reference's two torch ops do.
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * o_st + cols, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def triton_silu_mul(gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor,
                    config: KernelConfig = DEFAULTS) -> None:
    kernel = "triton.silu_mul"
    for name, t in (("gate", gate), ("up", up), ("out", out)):
        require(t.dim() == 2, kernel, lambda: f"{name} must be [T, I], got {tuple(t.shape)}")
        require(t.shape == gate.shape and t.dtype == gate.dtype, kernel,
                lambda: f"{name} {tuple(t.shape)} {t.dtype} must match gate {tuple(gate.shape)} {gate.dtype}")
        require_unit_last_stride(kernel, name, t)
    require_float(kernel, "gate", gate)
    require_device(kernel, gate, up, out)
    rows, width = gate.shape
    if rows == 0 or width == 0:
        return
    block = min(config.silu_mul_block, pow2(width))
    _silu_mul_kernel[(rows, triton.cdiv(width, block))](
        gate, up, out, width, gate.stride(0), up.stride(0), out.stride(0), BLOCK=block, num_warps=4,
        **pdl_launch(gate, config.pdl))


def _silu_mul_checker(types: Sequence[TensorType], attrs: Mapping[str, Any]) -> bool:
    return types[0].dtype in IR_FLOATS and types[0].rank == 2


register_impl("silu_mul", "triton", triton_silu_mul, checker=_silu_mul_checker, priority=10, wants_config=True)
