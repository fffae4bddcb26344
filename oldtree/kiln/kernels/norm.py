"""RMSNorm kernels: plain and fused with the residual add before it.

The Triton kernel normalizes rows of ``[T, hidden]`` activations and, for q/k-norm, rows of
``[T, heads, head_dim]`` (each head's vector is a row). Inputs may be views with row strides (the
q/k slices of a fused qkv output); each row itself must be contiguous.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import triton
import triton.language as tl

from kiln.ir.types import TensorType

from .config import DEFAULTS, KernelConfig
from .registry import register_impl
from .triton_support import (IR_FLOATS, await_previous_kernel, pdl_launch, pow2, require, require_device, require_float,
                             require_unit_last_stride)


def ref_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As HF's LlamaRMSNorm: normalize in f32, cast back, then scale in the input's dtype.
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def ref_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return ref_rmsnorm(summed, weight, eps), summed


def _rmsnorm(x, weight, *, out, eps):
    out.copy_(ref_rmsnorm(x, weight, eps))


def _add_rmsnorm(x, residual, weight, *, out, eps):
    normed, summed = ref_add_rmsnorm(x, residual, weight, eps)
    out[0].copy_(normed)
    out[1].copy_(summed)


register_impl("rmsnorm", "torch", _rmsnorm)
register_impl("add_rmsnorm", "torch", _add_rmsnorm)


# --- Triton -----------------------------------------------------------------------------------------

# A row is held whole in registers (one pass over memory); wider rows go to the torch reference.
MAX_HIDDEN = 32768


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr,
                    n_rows, heads, hidden, eps,
                    x_st, x_sh, r_st, r_sh, o_st, o_sh, s_st, s_sh,
                    HAS_RESIDUAL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    # Program i normalizes rows i*BLOCK_R .. +BLOCK_R of the [T, heads, hidden] view; row r is
    # (token r // heads, head r % heads), addressed through each tensor's own token/head strides.
    await_previous_kernel(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_H)
    token = (rows // heads).to(tl.int64)
    head = (rows % heads).to(tl.int64)
    mask = (rows < n_rows)[:, None] & (cols < hidden)[None, :]
    x = tl.load(x_ptr + (token * x_st + head * x_sh)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + (token * r_st + head * r_sh)[:, None] + cols[None, :], mask=mask, other=0.0)
        # The sum is rounded to the activation dtype before it is normalized, as the reference does.
        summed = (x + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + (token * s_st + head * s_sh)[:, None] + cols[None, :], summed, mask=mask)
        x = summed.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / hidden + eps)
    # Round the normalized value to the activation dtype first, then scale: the reference's order.
    normed = (x * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    y = normed * w[None, :]
    tl.store(out_ptr + (token * o_st + head * o_sh)[:, None] + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=mask)


def _token_head_strides(t: torch.Tensor) -> tuple[int, int]:
    """Strides of the token and head dims of a [T, hidden] (one head) or [T, heads, hidden] tensor."""
    return (t.stride(0), t.stride(1)) if t.dim() == 3 else (t.stride(0), 0)


def _check_like(kernel: str, name: str, t: torch.Tensor, x: torch.Tensor) -> None:
    require(t.shape == x.shape and t.dtype == x.dtype, kernel,
            lambda: f"{name} {tuple(t.shape)} {t.dtype} must match x {tuple(x.shape)} {x.dtype}")
    require_unit_last_stride(kernel, name, t)


def _launch(kernel: str, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            out: torch.Tensor, summed: torch.Tensor | None, eps: float, config: KernelConfig) -> None:
    require(x.dim() in (2, 3), kernel, lambda: f"x must be [T, hidden] or [T, heads, head_dim], got {tuple(x.shape)}")
    require_float(kernel, "x", x)
    require_unit_last_stride(kernel, "x", x)
    hidden = x.shape[-1]
    require(hidden <= MAX_HIDDEN, kernel, lambda: f"rows of {hidden} elements exceed the kernel's {MAX_HIDDEN}")
    require_float(kernel, "weight", weight)
    require(weight.shape == (hidden,) and weight.is_contiguous(), kernel,
            lambda: f"weight must be contiguous [{hidden}], got {tuple(weight.shape)} strides {weight.stride()}")
    _check_like(kernel, "out", out, x)
    tensors = [x, weight, out]
    if residual is not None and summed is not None:
        _check_like(kernel, "residual", residual, x)
        _check_like(kernel, "sum output", summed, x)
        tensors += [residual, summed]
    require_device(kernel, *tensors)

    heads = x.shape[1] if x.dim() == 3 else 1
    n_rows = x.shape[0] * heads
    if n_rows == 0:
        return
    block_h = pow2(hidden)
    block_r = min(pow2(n_rows), max(1, config.rmsnorm_elements_per_program // block_h))
    # About 16 elements per thread (32 threads a warp), between 1 and 16 warps.
    num_warps = min(16, max(1, block_r * block_h // 512))
    res = residual if residual is not None else x
    sm = summed if summed is not None else out
    _rmsnorm_kernel[(triton.cdiv(n_rows, block_r),)](
        x, res, weight, out, sm, n_rows, heads, hidden, eps,
        *_token_head_strides(x), *_token_head_strides(res), *_token_head_strides(out), *_token_head_strides(sm),
        HAS_RESIDUAL=residual is not None, BLOCK_R=block_r, BLOCK_H=block_h, num_warps=num_warps,
        **pdl_launch(x, config.pdl))


def triton_rmsnorm(x: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor, eps: float,
                   config: KernelConfig = DEFAULTS) -> None:
    _launch("triton.rmsnorm", x, None, weight, out, None, eps, config)


def triton_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *,
                       out: tuple[torch.Tensor, torch.Tensor], eps: float, config: KernelConfig = DEFAULTS) -> None:
    normed, summed = out
    _launch("triton.add_rmsnorm", x, residual, weight, normed, summed, eps, config)


def _takes(x: TensorType, weight: TensorType) -> bool:
    hidden = x.shape[-1] if x.rank else None
    return (x.dtype in IR_FLOATS and weight.dtype in IR_FLOATS and x.rank in (2, 3)
            and isinstance(hidden, int) and hidden <= MAX_HIDDEN)


def _rmsnorm_checker(types: Sequence[TensorType], attrs: Mapping[str, Any]) -> bool:
    return _takes(types[0], types[1])


def _add_rmsnorm_checker(types: Sequence[TensorType], attrs: Mapping[str, Any]) -> bool:
    return _takes(types[0], types[2])


register_impl("rmsnorm", "triton", triton_rmsnorm, checker=_rmsnorm_checker, priority=10, wants_config=True)
register_impl("add_rmsnorm", "triton", triton_add_rmsnorm, checker=_add_rmsnorm_checker, priority=10,
              wants_config=True)
