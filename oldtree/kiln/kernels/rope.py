"""Rotary position embedding (half-split layout) from a precomputed f32 cos/sin table.

The table is ``[max_positions, rot]``: columns ``[:rot/2]`` hold cos, ``[rot/2:]`` sin, already
scaled by the rope variant's attention factor. Only the first ``rot`` dims of each head rotate.

The Triton kernel takes ``x`` as ``[T, heads, head_dim]`` with any token and head strides (q and k
are usually views into a fused qkv output) and writes ``out`` the same way.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import triton
import triton.language as tl

from kiln.ir.types import DType, TensorType

from .config import DEFAULTS, KernelConfig
from .registry import register_impl
from .triton_support import (IR_FLOATS, IR_INDEXES, pow2, require, require_device, require_float, require_index,
                             require_unit_last_stride)


def ref_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    # The products happen in x's dtype, as in HF's apply_rotary_pos_emb, so bf16 results agree.
    rot = cos_sin.shape[1]
    half = rot // 2
    table = cos_sin[positions.long()]
    cos = table[:, None, :half].to(x.dtype)
    sin = table[:, None, half:].to(x.dtype)
    x1, x2, rest = x[..., :half], x[..., half:rot], x[..., rot:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def _rope(x, positions, cos_sin, *, out):
    out.copy_(ref_rope(x, positions, cos_sin))


register_impl("rope", "torch", _rope)


# --- Triton -----------------------------------------------------------------------------------------


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, cs_ptr, out_ptr, heads, head_dim, half,
                 x_st, x_sh, o_st, o_sh, cs_st,
                 BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    # Program (t, j) rotates heads j*BLOCK_HEADS .. +BLOCK_HEADS of token t. BLOCK_REST > 0 when the
    # head has dims past the rotary ones (partial rotary); those are copied unchanged.
    token = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    k = tl.arange(0, BLOCK_HALF)
    h_mask = h < heads
    k_mask = k < half
    mask = h_mask[:, None] & k_mask[None, :]
    dtype = x_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + token).to(tl.int64)
    # The reference casts the f32 table to x's dtype and rounds each product to it before the
    # add/sub; doing the same here in f32 gives bit-identical results.
    cos = tl.load(cs_ptr + pos * cs_st + k, mask=k_mask, other=0.0).to(dtype).to(tl.float32)[None, :]
    sin = tl.load(cs_ptr + pos * cs_st + half + k, mask=k_mask, other=0.0).to(dtype).to(tl.float32)[None, :]
    x_row = x_ptr + token * x_st + h[:, None].to(tl.int64) * x_sh
    o_row = out_ptr + token * o_st + h[:, None].to(tl.int64) * o_sh
    x1 = tl.load(x_row + k[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + half + k[None, :], mask=mask, other=0.0).to(tl.float32)
    y1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    y2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    tl.store(o_row + k[None, :], y1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_row + half + k[None, :], y2.to(out_ptr.dtype.element_ty), mask=mask)
    if BLOCK_REST > 0:
        d = 2 * half + tl.arange(0, BLOCK_REST)
        rest_mask = h_mask[:, None] & (d < head_dim)[None, :]
        tl.store(o_row + d[None, :], tl.load(x_row + d[None, :], mask=rest_mask), mask=rest_mask)


def triton_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, *, out: torch.Tensor,
                config: KernelConfig = DEFAULTS) -> None:
    """Rotates ``x`` into ``out``. Positions must index rows of ``cos_sin`` (not checked: no host sync).
    A program loads its token's cos/sin row once and applies it to up to
    ``config.rope_elements_per_program`` elements of heads."""
    kernel = "triton.rope"
    require(x.dim() == 3, kernel, lambda: f"x must be [T, heads, head_dim], got {tuple(x.shape)}")
    require_float(kernel, "x", x)
    require_unit_last_stride(kernel, "x", x)
    require(out.shape == x.shape and out.dtype == x.dtype, kernel,
            lambda: f"out {tuple(out.shape)} {out.dtype} must match x {tuple(x.shape)} {x.dtype}")
    require_unit_last_stride(kernel, "out", out)
    require_index(kernel, "positions", positions)
    require(positions.shape[0] == x.shape[0], kernel,
            lambda: f"positions {tuple(positions.shape)} do not match x {tuple(x.shape)}")
    require(cos_sin.dtype == torch.float32 and cos_sin.dim() == 2 and cos_sin.stride(1) == 1, kernel,
            lambda: f"cos_sin must be an f32 [positions, rot] table with contiguous rows, got {cos_sin.dtype} "
            f"{tuple(cos_sin.shape)} strides {cos_sin.stride()}")
    tokens, heads, head_dim = x.shape
    rot = cos_sin.shape[1]
    require(rot % 2 == 0 and 0 < rot <= head_dim, kernel,
            lambda: f"rotary width {rot} must be even and <= head_dim {head_dim}")
    require_device(kernel, x, positions, cos_sin, out)
    if tokens == 0 or heads == 0:
        return
    block_half = pow2(rot // 2)
    block_rest = pow2(head_dim - rot) if head_dim > rot else 0
    block_heads = min(pow2(heads), max(1, config.rope_elements_per_program // (2 * block_half + block_rest)))
    _rope_kernel[(tokens, triton.cdiv(heads, block_heads))](
        x, positions, cos_sin, out, heads, head_dim, rot // 2,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos_sin.stride(0),
        BLOCK_HEADS=block_heads, BLOCK_HALF=block_half, BLOCK_REST=block_rest, num_warps=4,
        # With fusion on, LLVM folds `round(a * b) - c` into one fma that skips the product's rounding
        # (measured on an H200: 17% of bf16/f16 results then differ from the reference by an ulp).
        enable_fp_fusion=False)


def _rope_checker(types: Sequence[TensorType], attrs: Mapping[str, Any]) -> bool:
    x, positions, cos_sin = types
    return x.dtype in IR_FLOATS and positions.dtype in IR_INDEXES and cos_sin.dtype == DType.f32


register_impl("rope", "triton", triton_rope, checker=_rope_checker, priority=10, wants_config=True)
