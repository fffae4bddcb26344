"""Writing each token's K and V into its slot of the paged pool (slot -1: a padding token, skipped).

The Triton kernel scatters ``[T, kv_heads, head_dim]`` k and v (views with token/head strides are
fine: they usually come from a fused qkv output) into contiguous ``[NS, kv_heads, head_dim]`` caches.

An FP8 pool (float8 e4m3fn caches, ``kiln compile --kv-cache-dtype fp8_e4m3``) stores k / k_scale and
v / v_scale, saturated to e4m3's range and rounded to nearest (``to_cache``); attention reads them back
times the scale (``from_cache``). The scales are per tensor (one for K and one for V per layer, 1.0
unless calibrated ones are given).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import triton
import triton.language as tl

from kiln.ir.types import DType, TensorType

from .attention_block import to_fp8
from .config import DEFAULTS, KernelConfig
from .registry import register_impl
from .triton_support import (IR_FLOATS, IR_INDEXES, pow2, require, require_device, require_float, require_index,
                             require_unit_last_stride)


FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``x`` as a pool of ``cache_dtype`` stores it."""
    if cache_dtype != FP8:
        return x.to(cache_dtype)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def from_cache(stored: torch.Tensor, scale: float) -> torch.Tensor:
    """What the pool's ``stored`` values hold, in f32."""
    return stored.float() * scale if stored.dtype == FP8 else stored.float()


def ref_kv_store(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slots: torch.Tensor, *, k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    keep = slots >= 0
    index = slots[keep].long()
    k_cache[index] = to_cache(k[keep], k_cache.dtype, k_scale)
    v_cache[index] = to_cache(v[keep], v_cache.dtype, v_scale)
    return k_cache, v_cache


register_impl("kv_store", "torch", ref_kv_store)


# --- Triton -----------------------------------------------------------------------------------------


@triton.jit
def _kv_store_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, width, head_dim,
                     k_st, k_sh, v_st, v_sh, c_ss, c_sh, k_scale, v_scale, BLOCK: tl.constexpr, KV_FP8: tl.constexpr):
    # Program (t, j) copies elements j*BLOCK .. +BLOCK of token t's flattened [kv_heads * head_dim]
    # K and V rows into the token's slot. Slots are widened to int64: pools pass 2**31 elements.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot >= 0:
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = i < width
        head = (i // head_dim).to(tl.int64)
        d = i % head_dim
        dst = slot * c_ss + head * c_sh + d
        k = tl.load(k_ptr + token * k_st + head * k_sh + d, mask=mask)
        v = tl.load(v_ptr + token * v_st + head * v_sh + d, mask=mask)
        if KV_FP8:
            k = to_fp8(k, k_scale, kc_ptr.dtype.element_ty)
            v = to_fp8(v, v_scale, vc_ptr.dtype.element_ty)
        tl.store(kc_ptr + dst, k, mask=mask)
        tl.store(vc_ptr + dst, v, mask=mask)


def triton_kv_store(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    slots: torch.Tensor, config: KernelConfig = DEFAULTS, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes k/v rows into the caches in place and returns the caches. Slots must be < NS (not
    checked: that would need a host sync); slots < 0 are skipped; duplicate slots race."""
    kernel = "triton.kv_store"
    require(k_cache.dim() == 3 and k_cache.is_contiguous() and v_cache.is_contiguous(), kernel,
            lambda: f"caches must be contiguous [NS, kv_heads, head_dim], got {tuple(k_cache.shape)} strides "
            f"{k_cache.stride()} and {tuple(v_cache.shape)} strides {v_cache.stride()}")
    require(v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype, kernel,
            lambda: f"v_cache {tuple(v_cache.shape)} {v_cache.dtype} must match k_cache {tuple(k_cache.shape)} "
            f"{k_cache.dtype}")
    fp8 = k_cache.dtype == FP8
    if not fp8:
        require_float(kernel, "k_cache", k_cache)
    for name, t in (("k", k), ("v", v)):
        require(t.dim() == 3 and t.shape[1:] == k_cache.shape[1:] and (t.dtype == k_cache.dtype or fp8), kernel,
                lambda: f"{name} {tuple(t.shape)} {t.dtype} does not fit cache {tuple(k_cache.shape)} {k_cache.dtype}")
        require_float(kernel, name, t)
        require_unit_last_stride(kernel, name, t)
    require(v.shape == k.shape, kernel, lambda: f"v {tuple(v.shape)} must match k {tuple(k.shape)}")
    require_index(kernel, "slots", slots)
    require(slots.shape[0] == k.shape[0], kernel, lambda: f"slots {tuple(slots.shape)} do not match k {tuple(k.shape)}")
    require_device(kernel, k_cache, v_cache, k, v, slots)
    tokens, kv_heads, head_dim = k.shape
    width = kv_heads * head_dim
    if tokens and width:
        block = min(config.kv_store_block, pow2(width))
        _kv_store_kernel[(tokens, triton.cdiv(width, block))](
            k, v, k_cache, v_cache, slots, width, head_dim,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1),
            k_scale, v_scale, BLOCK=block, KV_FP8=fp8, num_warps=4)
    return k_cache, v_cache


def _kv_store_checker(types: Sequence[TensorType], attrs: Mapping[str, Any]) -> bool:
    k_cache, v_cache, k, v, slots = types
    return (k.dtype in IR_FLOATS and k_cache.dtype in (k.dtype, DType.f8e4m3) and v.dtype == k.dtype
            and slots.dtype in IR_INDEXES)


register_impl("kv_store", "triton", triton_kv_store, checker=_kv_store_checker, priority=10, wants_config=True)
