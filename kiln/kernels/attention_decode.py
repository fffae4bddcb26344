"""Paged attention for decode steps (every sequence has at most one new token): split-KV flash decoding.

Grid ``(sequences, kv_heads, splits)``: program ``(b, g, s)`` takes the ``s``-th of ``splits`` equal
slices of sequence ``b``'s context and attends *all* query heads of KV group ``g`` to it at once, so
each K/V entry is read from memory once per step (the query heads form the rows of one tile, padded
to 16 for the tensor cores). With one split the program writes the output itself; with several it
writes an f32 partial output and its log-sum-exp per head, and ``_combine_kernel`` merges the splits.
The split count is a runtime argument (not a compile-time constant) so that batches of every size
share one compiled kernel.

Splitting a long context is what keeps the GPU busy at small batch (B * kv_heads programs alone
would leave most SMs idle); how many splits is a host-side choice (``decode_splits``) that never
changes the result, so a CUDA graph captured with one split count stays correct for any lengths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_block import attend_block
from .triton_support import dot_in_f32, pow2

# Below this many context tokens per split the fixed per-program cost (loading q, the combine
# traffic) outweighs the extra parallelism.
MIN_SPLIT_TOKENS = 128
MAX_SPLITS = 64
# Keys per loop step. Measured on an H200 (B=64 and B=8, 4096-token contexts, 8 KV heads of 128):
# 64 keys at 4 warps and 2 stages read 4.4 TB/s; 32 keys, 8 warps or 3 stages were slower.
DECODE_BLOCK_N = 64


@triton.jit
def _decode_kernel(q_ptr, kc_ptr, vc_ptr, out_ptr, part_o_ptr, part_lse_ptr,
                   q_start_ptr, q_len_ptr, kv_len_ptr, pt_ptr,
                   q_st, q_sh, o_st, o_sh, slot_stride, head_stride, pt_stride,
                   num_heads, group, head_dim, page_size, scale, soft_cap, window, num_splits,
                   SPLIT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   SOFT_CAP: tl.constexpr, SLIDING: tl.constexpr, DOT_F32: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if tl.load(q_len_ptr + b) == 0:
        return
    q_start = tl.load(q_start_ptr + b).to(tl.int64)
    kv_len = tl.load(kv_len_ptr + b)
    # The one query sits at position kv_len - 1; a window keeps keys j > kv_len - 1 - window.
    if SLIDING:
        lo = tl.maximum(kv_len - window, 0)
    else:
        lo = 0
    # Splits are whole key blocks; trailing splits of a short context may be empty, and then write
    # a zero output with log-sum-exp -inf, which the combine weighs as nothing.
    per_split = tl.cdiv(tl.cdiv(kv_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, kv_len)

    g = tl.arange(0, BLOCK_G)
    g_mask = g < group
    heads = kv_head * group + g
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + q_start * q_st + heads[:, None] * q_sh + offs_d[None, :], mask=mask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    q_pos = tl.zeros([BLOCK_G], tl.int32) + (kv_len - 1)

    k_base = kc_ptr + kv_head.to(tl.int64) * head_stride
    v_base = vc_ptr + kv_head.to(tl.int64) * head_stride
    page_row = pt_ptr + b.to(tl.int64) * pt_stride
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    # Every key in [start, end) is causally visible and inside the window; MASKED only cuts the
    # block at `end`.
    for n0 in range(start, end, BLOCK_N):
        acc, m_i, l_i = attend_block(acc, m_i, l_i, q, q_pos, k_base, v_base, page_row, n0, end, slot_stride,
                                     page_size, offs_d, d_mask, scale, soft_cap, window, MASKED=True,
                                     SOFT_CAP=SOFT_CAP, SLIDING=False, DOT_F32=DOT_F32, BLOCK_N=BLOCK_N)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SPLIT:
        # Partials are [B, heads, splits, head_dim] and [B, heads, splits]; the lse is in base 2.
        part = (b.to(tl.int64) * num_heads + heads) * num_splits + split
        tl.store(part_o_ptr + part[:, None] * head_dim + offs_d[None, :], out, mask=mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=g_mask)
    else:
        tl.store(out_ptr + q_start * o_st + heads[:, None] * o_sh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _combine_kernel(part_o_ptr, part_lse_ptr, out_ptr, q_start_ptr, q_len_ptr, o_st, o_sh, num_heads, head_dim,
                    num_splits, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    # Program (b, h) merges the splits of one head: out = sum_s w_s o_s / sum_s w_s with
    # w_s = 2^(lse_s - max lse), the softmax over the splits' log-sum-exps.
    b = tl.program_id(0)
    head = tl.program_id(1)
    if tl.load(q_len_ptr + b) == 0:
        return
    s = tl.arange(0, BLOCK_S)
    s_mask = s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    part = (b.to(tl.int64) * num_heads + head) * num_splits + s
    lse = tl.load(part_lse_ptr + part, mask=s_mask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    o = tl.load(part_o_ptr + part[:, None] * head_dim + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :],
                other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    q_start = tl.load(q_start_ptr + b).to(tl.int64)
    tl.store(out_ptr + q_start * o_st + head * o_sh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def decode_splits(batch: int, kv_heads: int, kv_bound: int, sm_count: int) -> int:
    """How many slices to cut each context into: enough programs for about two per SM, but no slice
    under ``MIN_SPLIT_TOKENS`` of the longest possible context ``kv_bound``."""
    wanted = triton.cdiv(2 * sm_count, max(1, batch * kv_heads))
    most = triton.cdiv(max(kv_bound, 1), MIN_SPLIT_TOKENS)
    return max(1, min(wanted, most, MAX_SPLITS))


def launch_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_start: torch.Tensor,
                  q_len: torch.Tensor, kv_len: torch.Tensor, page_table: torch.Tensor, out: torch.Tensor, *,
                  scale: float, page_size: int, sliding_window: int, soft_cap: float, num_splits: int,
                  block_n: int = DECODE_BLOCK_N) -> None:
    """Launches decode attention on inputs the dispatcher has checked; every ``q_len[b]`` must be 0 or 1."""
    tokens, heads, head_dim = q.shape
    batch, kv_heads = q_len.shape[0], k_cache.shape[1]
    if tokens == 0 or batch == 0:
        return
    group = heads // kv_heads
    block_d = pow2(head_dim, 16)
    if num_splits > 1:
        part_o = torch.empty((batch, heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        # Never touched with one split (the kernel writes `out` directly); any f32 tensor will do.
        part_o = part_lse = out.new_empty(0, dtype=torch.float32)
    _decode_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_o, part_lse, q_start, q_len, kv_len, page_table,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        page_table.stride(0), heads, group, head_dim, page_size, scale, soft_cap, sliding_window, num_splits,
        SPLIT=num_splits > 1, BLOCK_G=pow2(group, 16), BLOCK_N=block_n, BLOCK_D=block_d,
        SOFT_CAP=soft_cap > 0, SLIDING=sliding_window > 0, DOT_F32=dot_in_f32(q.dtype), num_warps=4, num_stages=2)
    if num_splits > 1:
        _combine_kernel[(batch, heads)](
            part_o, part_lse, out, q_start, q_len, out.stride(0), out.stride(1), heads, head_dim, num_splits,
            BLOCK_S=pow2(num_splits), BLOCK_D=block_d, num_warps=4)
