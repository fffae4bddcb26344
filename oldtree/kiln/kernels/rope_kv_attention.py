"""``rope_kv_attention``: one layer's rotary embedding, KV store and paged attention as one op.

The reference composes the parts it replaces (``ref_rope_kv_store``, then ``ref_paged_attention``).
The Triton implementation is the paged attention dispatcher given the step's new tokens: a decode
step rotates q and k and stores k and v inside the split-KV decode kernel (one launch a layer
instead of two; see ``attention_decode``), any other step runs the Triton rope and KV store
kernels before the extend kernel, where two small launches hardly show beside the attention.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from kiln.ir.types import DType, TensorType

from .attention import MAX_HEAD_DIM, ref_paged_attention, triton_paged_attention
from .attention_decode import NewTokens
from .config import DEFAULTS, KernelConfig
from .registry import register_impl
from .rope_kv_store import ref_rope_kv_store
from .triton_support import IR_FLOATS, IR_INDEXES, require, require_device, require_index, require_unit_last_stride


def ref_rope_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                          cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                          q_start: torch.Tensor, q_len: torch.Tensor, kv_len: torch.Tensor, page_table: torch.Tensor,
                          tree_mask: torch.Tensor | None = None, *, scale: float, page_size: int,
                          sliding_window: int = 0, soft_cap: float = 0.0, k_scale: float = 1.0,
                          v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (attention output, k_cache, v_cache); the caches are updated in place."""
    q_rot, k_cache, v_cache = ref_rope_kv_store(q, k, v, positions, cos_sin, k_cache, v_cache, slots,
                                                k_scale=k_scale, v_scale=v_scale)
    out = ref_paged_attention(q_rot, k_cache, v_cache, q_start, q_len, kv_len, page_table, tree_mask, scale=scale,
                              page_size=page_size, sliding_window=sliding_window, soft_cap=soft_cap,
                              k_scale=k_scale, v_scale=v_scale)
    return out, k_cache, v_cache


def _rope_kv_attention(q, k, v, positions, cos_sin, k_cache, v_cache, slots, q_start, q_len, kv_len, page_table,
                       tree_mask=None, *, out, **attrs):
    out.copy_(ref_rope_kv_attention(q, k, v, positions, cos_sin, k_cache, v_cache, slots, q_start, q_len, kv_len,
                                    page_table, tree_mask, **attrs)[0])


register_impl("rope_kv_attention", "torch", _rope_kv_attention, reads_device=True)


def triton_rope_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                             cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                             q_start: torch.Tensor, q_len: torch.Tensor, kv_len: torch.Tensor,
                             page_table: torch.Tensor, tree_mask: torch.Tensor | None = None, *, out: torch.Tensor,
                             scale: float, page_size: int, sliding_window: int = 0, soft_cap: float = 0.0,
                             k_scale: float = 1.0,
                             v_scale: float = 1.0, sizes: Mapping[str, int] | None = None,
                             config: KernelConfig = DEFAULTS) -> None:
    """Writes the attention output into ``out`` and the step's rotated k and v into the pool. The
    decode path stores only the tokens that are some sequence's query (every token of a decode
    step); positions must index rows of ``cos_sin`` and slots the pool (not checked: no host sync)."""
    kernel = "triton.rope_kv_attention"
    for name, t in (("k", k), ("v", v)):
        require(t.dim() == 3 and t.shape[0] == q.shape[0] and t.shape[1:] == k_cache.shape[1:]
                and t.dtype == q.dtype, kernel,
                lambda: f"{name} {tuple(t.shape)} {t.dtype} must be [{q.shape[0]}, kv_heads, head_dim] of the "
                f"cache {tuple(k_cache.shape)} in q's dtype {q.dtype}")
        require_unit_last_stride(kernel, name, t)
    for name, t in (("positions", positions), ("slots", slots)):
        require_index(kernel, name, t)
        require(t.shape == (q.shape[0],), kernel, lambda: f"{name} {tuple(t.shape)} must be [{q.shape[0]}]")
    require(cos_sin.dtype == torch.float32 and cos_sin.dim() == 2 and cos_sin.stride(1) == 1, kernel,
            lambda: f"cos_sin must be an f32 [positions, rot] table with contiguous rows, got {cos_sin.dtype} "
            f"{tuple(cos_sin.shape)} strides {cos_sin.stride()}")
    rot = cos_sin.shape[1]
    require(rot % 2 == 0 and 0 < rot <= q.shape[-1], kernel,
            lambda: f"rotary width {rot} must be even and <= head_dim {q.shape[-1]}")
    require_device(kernel, q, k, v, positions, cos_sin, slots)
    triton_paged_attention(q, k_cache, v_cache, q_start, q_len, kv_len, page_table, tree_mask, out=out, scale=scale,
                           page_size=page_size, sliding_window=sliding_window, soft_cap=soft_cap, sizes=sizes,
                           new_tokens=NewTokens(k, v, positions, cos_sin, slots), config=config, k_scale=k_scale,
                           v_scale=v_scale)


def _checker(types: Sequence[TensorType], attrs: Mapping[str, Any]) -> bool:
    q, k, v, positions, cos_sin, k_cache, v_cache, slots, q_start, q_len, kv_len, page_table = types[:12]
    head_dim = q.shape[2] if q.rank == 3 else None
    return (q.dtype in IR_FLOATS and all(t.dtype == q.dtype for t in (k, v))
            and k_cache.dtype in (q.dtype, DType.f8e4m3) and v_cache.dtype == k_cache.dtype
            and isinstance(head_dim, int) and head_dim <= MAX_HEAD_DIM and cos_sin.dtype == DType.f32
            and all(t.dtype in IR_INDEXES for t in (positions, slots, q_start, q_len, kv_len, page_table)))


register_impl("rope_kv_attention", "triton", triton_rope_kv_attention, checker=_checker, priority=10,
              wants_sizes=True, wants_config=True)
