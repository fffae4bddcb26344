"""Paged attention: each sequence's new tokens attend causally over its whole context in the pool.

Sequence ``b`` owns query rows ``q_start[b] : q_start[b] + q_len[b]`` and a context of
``kv_len[b]`` tokens (the new ones last) whose K/V sit at slots
``page_table[b, j // page_size] * page_size + j % page_size``. Query heads share KV heads in
groups (GQA). The reference loops over sequences on the host; the Triton kernels do not.

The Triton implementation picks its kernel from host-side facts in ``sizes``: ``max_q_len <= 1``
(a decode step) takes split-KV flash decoding (``attention_decode``), anything else or an unknown
``max_q_len`` the extend kernel (``attention_extend``). Rows of ``out`` that belong to no sequence
are left as they were (the reference happens to zero them); padding rows are never read downstream.

A tree mask (``tree_mask``, optional: speculative draft trees, whose nodes sit side by side in the
context and see only their ancestors) gives each query row an i32 whose bit ``j`` says whether the
key at context position ``kv_len - TREE_WINDOW_KEYS + j`` (the context's last 32) counts, on top of the
causal rule; -1 keeps every key (plain causal). It applies to sequences of more than one new token
(a single new token sees its whole context, as in a decode step, whose kernel never reads the mask).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from kiln.ir.types import DType, TensorType

from .attention_block import TREE_WINDOW_KEYS
from .attention_decode import NewTokens, decode_splits, launch_decode
from .attention_extend import extend_blocks, launch_extend
from .config import DEFAULTS, KernelConfig
from .kv_store import FP8, from_cache, triton_kv_store
from .registry import register_impl
from .rope import triton_rope
from .triton_support import (IR_FLOATS, IR_INDEXES, require, require_device, require_float, require_index,
                             require_unit_last_stride, sm_count)


def context_slots(page_row: torch.Tensor, length: int, page_size: int) -> torch.Tensor:
    """The pool slots of the first ``length`` tokens of a sequence with page-table row ``page_row``."""
    positions = torch.arange(length, device=page_row.device)
    return page_row[positions // page_size].long() * page_size + positions % page_size


def ref_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_start: torch.Tensor,
                        q_len: torch.Tensor, kv_len: torch.Tensor, page_table: torch.Tensor,
                        tree_mask: torch.Tensor | None = None, *, scale: float, page_size: int, sliding_window: int = 0,
                        soft_cap: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    out = torch.zeros_like(q)
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    group = heads // kv_heads
    for b, (start, n, length) in enumerate(zip(q_start.tolist(), q_len.tolist(), kv_len.tolist())):
        if n == 0:
            continue
        slots = context_slots(page_table[b], length, page_size)
        k = from_cache(k_cache[slots], k_scale).repeat_interleave(group, dim=1)  # [L, H, D]
        v = from_cache(v_cache[slots], v_scale).repeat_interleave(group, dim=1)
        qs = q[start:start + n].float()  # [n, H, D]
        scores = torch.einsum("nhd,lhd->hnl", qs, k) * scale
        if soft_cap > 0:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = torch.arange(length - n, length, device=q.device)[:, None]
        k_pos = torch.arange(length, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window > 0:
            allowed &= k_pos > q_pos - sliding_window
        if tree_mask is not None and n > 1:
            tree_start = length - TREE_WINDOW_KEYS
            bits = tree_mask[start:start + n].long()[:, None]
            in_tree = k_pos >= tree_start
            allowed &= ~in_tree | ((bits >> (k_pos - tree_start).clamp(0, TREE_WINDOW_KEYS - 1)) & 1).bool()
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:start + n] = torch.einsum("hnl,lhd->nhd", probs, v).to(q.dtype)
    return out


def _paged_attention(q, k_cache, v_cache, q_start, q_len, kv_len, page_table, tree_mask=None, *, out, **attrs):
    out.copy_(ref_paged_attention(q, k_cache, v_cache, q_start, q_len, kv_len, page_table, tree_mask, **attrs))


register_impl("paged_attention", "torch", _paged_attention, reads_device=True)  # loops over the lengths


# --- Triton -----------------------------------------------------------------------------------------

# BLOCK_D (the padded head dim) times the key block must fit registers and shared memory.
MAX_HEAD_DIM = 256


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor,
           kv_len: torch.Tensor, page_table: torch.Tensor, out: torch.Tensor, page_size: int) -> None:
    kernel = "triton.paged_attention"
    require(q.dim() == 3, kernel, lambda: f"q must be [T, heads, head_dim], got {tuple(q.shape)}")
    require_float(kernel, "q", q)
    require_unit_last_stride(kernel, "q", q)
    require(out.shape == q.shape and out.dtype == q.dtype, kernel,
            lambda: f"out {tuple(out.shape)} {out.dtype} must match q {tuple(q.shape)} {q.dtype}")
    require_unit_last_stride(kernel, "out", out)
    require(k_cache.dim() == 3 and k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride(), kernel,
            lambda: f"k_cache {tuple(k_cache.shape)} strides {k_cache.stride()} and v_cache "
            f"{tuple(v_cache.shape)} strides {v_cache.stride()} must be alike [NS, kv_heads, head_dim]")
    require_unit_last_stride(kernel, "k_cache", k_cache)
    require(k_cache.dtype in (q.dtype, FP8) and v_cache.dtype == k_cache.dtype, kernel,
            lambda: f"caches ({k_cache.dtype}, {v_cache.dtype}) must have q's dtype {q.dtype} (or both be {FP8})")
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1]
    require(k_cache.shape[2] == head_dim, kernel,
            lambda: f"cache head dim {k_cache.shape[2]} differs from q's {head_dim}")
    require(head_dim <= MAX_HEAD_DIM, kernel, lambda: f"head_dim {head_dim} exceeds the kernels' {MAX_HEAD_DIM}")
    require(kv_heads > 0 and heads % kv_heads == 0, kernel,
            lambda: f"{heads} query heads cannot share {kv_heads} kv heads")
    for name, t in (("q_start", q_start), ("q_len", q_len), ("kv_len", kv_len)):
        require_index(kernel, name, t)
        require(t.shape == q_start.shape, kernel,
                lambda: f"{name} {tuple(t.shape)} differs from q_start {tuple(q_start.shape)}")
    require_index(kernel, "page_table", page_table, rank=2)
    require(page_table.shape[0] == q_start.shape[0], kernel,
            lambda: f"page_table {tuple(page_table.shape)} has a different batch size than q_start "
            f"{tuple(q_start.shape)}")
    require(page_size >= 1, kernel, lambda: f"page_size must be >= 1, got {page_size}")
    require_device(kernel, q, k_cache, v_cache, q_start, q_len, kv_len, page_table, out)


def triton_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_start: torch.Tensor,
                           q_len: torch.Tensor, kv_len: torch.Tensor, page_table: torch.Tensor,
                           tree_mask: torch.Tensor | None = None, *, out: torch.Tensor, scale: float,
                           page_size: int, sliding_window: int = 0, soft_cap: float = 0.0,
                           sizes: Mapping[str, int] | None = None, new_tokens: NewTokens | None = None,
                           config: KernelConfig = DEFAULTS, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Writes each sequence's attention output into its rows of ``out``. Reads only host facts
    (shapes and ``sizes``), never device values, so the decode path can be captured in a CUDA graph.

    ``sizes["max_q_len"]`` must bound every ``q_len[b]`` when given; ``sizes["max_kv_len"]`` (when
    given, else the page table's width) only steers how many splits decode uses. Preconditions not
    checked (they would need a host sync): ``q_len[b] <= kv_len[b]``, ``kv_len[b] >= 1`` where
    ``q_len[b] > 0``, and the page table names a valid page for every position below ``kv_len[b]``.

    With ``new_tokens`` (``rope_kv_attention``), ``q`` is unrotated and the step's k and v are not in
    the pool yet: a decode step rotates and stores them inside the decode kernel, any other step
    with the Triton rope and KV store kernels before the extend kernel.
    """
    _check(q, k_cache, v_cache, q_start, q_len, kv_len, page_table, out, page_size)
    if tree_mask is not None:
        require(tree_mask.dtype == torch.int32 and tree_mask.shape == (q.shape[0],), "triton.paged_attention",
                lambda: f"tree_mask must be i32 [{q.shape[0]}] (a row per query token), got {tree_mask.dtype} "
                f"{tuple(tree_mask.shape)}")
        require_device("triton.paged_attention", q, tree_mask)
    sizes = sizes or {}
    tokens, heads, head_dim = q.shape
    max_q_len = sizes.get("max_q_len")
    common = dict(scale=scale, page_size=page_size, sliding_window=sliding_window, soft_cap=soft_cap,
                  k_scale=k_scale, v_scale=v_scale)
    if max_q_len is not None and max_q_len <= 1:
        kv_bound = page_table.shape[1] * page_size
        if sizes.get("max_kv_len") is not None:
            kv_bound = min(kv_bound, sizes["max_kv_len"])
        if sliding_window > 0:
            kv_bound = min(kv_bound, sliding_window)
        splits = decode_splits(q_len.shape[0], k_cache.shape[1], kv_bound, sm_count(q), config)
        launch_decode(q, k_cache, v_cache, q_start, q_len, kv_len, page_table, out, num_splits=splits,
                      new_tokens=new_tokens, config=config, **common)
        return
    if new_tokens is not None:
        new = new_tokens
        q_rot, k_rot = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty_like(new.k)
        triton_rope(q, new.positions, new.cos_sin, out=q_rot, config=config)
        triton_rope(new.k, new.positions, new.cos_sin, out=k_rot, config=config)
        triton_kv_store(k_cache, v_cache, k_rot, new.v, new.slots, config=config, k_scale=k_scale, v_scale=v_scale)
        q = q_rot
    # An unknown max_q_len is bounded by the step's token count.
    bound = tokens if max_q_len is None else min(max_q_len, tokens)
    block_m, block_n, warps = extend_blocks(bound, head_dim)
    launch_extend(q, k_cache, v_cache, q_start, q_len, kv_len, page_table, out, max_q_len=bound,
                  block_m=block_m, block_n=block_n, num_warps=warps, tree_mask=tree_mask, **common)


def _paged_attention_checker(types: Sequence[TensorType], attrs: Mapping[str, Any]) -> bool:
    q, k_cache, v_cache, q_start, q_len, kv_len, page_table = types[:7]
    head_dim = q.shape[2] if q.rank == 3 else None
    return (q.dtype in IR_FLOATS and k_cache.dtype in (q.dtype, DType.f8e4m3) and v_cache.dtype == k_cache.dtype
            and isinstance(head_dim, int) and head_dim <= MAX_HEAD_DIM
            and all(t.dtype in IR_INDEXES for t in (q_start, q_len, kv_len, page_table)))


register_impl("paged_attention", "triton", triton_paged_attention, checker=_paged_attention_checker, priority=10,
              wants_sizes=True, wants_config=True)
