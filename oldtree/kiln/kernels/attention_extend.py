"""Paged attention for prefill and mixed steps: every sequence's new tokens in one launch.

Grid ``(query blocks, heads, sequences)``: program ``(i, h, b)`` takes query rows
``i*BLOCK_M .. +BLOCK_M`` of sequence ``b``'s ``q_len[b]`` new tokens for head ``h`` and runs a flash
attention loop over the sequence's context in the pool. The first grid axis is sized for the longest
sequence (``max_q_len`` from the host, else ``T``); programs past their own sequence's length return
at once, so any mix of lengths (zero too) runs in one launch without a host sync. Blocks are issued
last-first: the last query block of a causal sequence has the most keys to read.

Keys in blocks that lie wholly before the tile's first query skip the per-score causal mask; the
blocks that straddle the diagonal (and all blocks under a sliding window) apply it. With a tree mask
(speculative draft trees: ``attention.py``), the blocks reaching the context's last ``TREE_WINDOW``
keys apply each row's bits there too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_block import TREE_WINDOW, attend_block
from .triton_support import dot_in_f32, pow2


@triton.jit
def _extend_kernel(q_ptr, kc_ptr, vc_ptr, out_ptr, q_start_ptr, q_len_ptr, kv_len_ptr, pt_ptr, tree_ptr,
                   q_st, q_sh, o_st, o_sh, slot_stride, head_stride, pt_stride,
                   num_m_blocks, group, head_dim, page_size, scale, soft_cap, window, k_scale, v_scale,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   SOFT_CAP: tl.constexpr, SLIDING: tl.constexpr, DOT_F32: tl.constexpr, KV_FP8: tl.constexpr,
                   TREE: tl.constexpr):
    m_block = num_m_blocks - 1 - tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2)
    q_len = tl.load(q_len_ptr + b)
    if m_block * BLOCK_M >= q_len:
        return
    q_start = tl.load(q_start_ptr + b).to(tl.int64)
    kv_len = tl.load(kv_len_ptr + b)

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    # The new tokens are the last q_len of the kv_len context positions.
    q_pos = kv_len - q_len + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    rows = q_start + offs_m
    q = tl.load(q_ptr + rows[:, None] * q_st + head * q_sh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    # Each row's tree bits over the context's last TREE_WINDOW keys (-1: all of them, plain causal).
    tree_start = kv_len - TREE_WINDOW
    if TREE and q_len > 1:  # (a single new token sees its whole context: the decode kernel's rule)
        tree_bits = tl.load(tree_ptr + rows, mask=m_mask, other=-1)
    else:
        tree_bits = tl.full([BLOCK_M], -1, tl.int32)

    kv_head = (head // group).to(tl.int64)
    k_base = kc_ptr + kv_head * head_stride
    v_base = vc_ptr + kv_head * head_stride
    page_row = pt_ptr + b.to(tl.int64) * pt_stride
    first_pos = kv_len - q_len + m_block * BLOCK_M
    # One past the context position of the tile's last real query.
    kv_end = tl.minimum(kv_len, first_pos + BLOCK_M)
    if SLIDING:
        lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
        unmasked_end = lo
    else:
        lo = 0
        unmasked_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    if TREE:
        unmasked_end = tl.minimum(unmasked_end, tl.maximum(tree_start, 0) // BLOCK_N * BLOCK_N)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(lo, unmasked_end, BLOCK_N):
        acc, m_i, l_i = attend_block(acc, m_i, l_i, q, q_pos, k_base, v_base, page_row, n0, kv_end, slot_stride,
                                     page_size, offs_d, d_mask, scale, soft_cap, window, k_scale, v_scale,
                                     tree_bits, tree_start, MASKED=False, SOFT_CAP=SOFT_CAP, SLIDING=SLIDING,
                                     DOT_F32=DOT_F32, BLOCK_N=BLOCK_N, KV_FP8=KV_FP8, DTYPE=q_ptr.dtype.element_ty,
                                     TREE=False)
    for n0 in range(unmasked_end, kv_end, BLOCK_N):
        acc, m_i, l_i = attend_block(acc, m_i, l_i, q, q_pos, k_base, v_base, page_row, n0, kv_end, slot_stride,
                                     page_size, offs_d, d_mask, scale, soft_cap, window, k_scale, v_scale,
                                     tree_bits, tree_start, MASKED=True, SOFT_CAP=SOFT_CAP, SLIDING=SLIDING,
                                     DOT_F32=DOT_F32, BLOCK_N=BLOCK_N, KV_FP8=KV_FP8, DTYPE=q_ptr.dtype.element_ty,
                                     TREE=TREE)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * o_st + head * o_sh + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & d_mask[None, :])


def extend_blocks(max_q_len: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for a step whose longest sequence has ``max_q_len`` new tokens.

    Long prompts take 128-row tiles (8 warps; the tensor cores' natural size); short ones (chunked
    tails, speculative verification) 16 or 64 rows so that little of each tile is padding. Heads of
    256 halve the row tile to keep the f32 accumulator in registers. Measured on an H200 (1x2048 and
    8x512 prompts, head_dim 128): 128x64 tiles at 8 warps and 2 stages ran 220 and 150 TFLOP/s;
    128x128 was within 3%, 3 stages or 4 warps slower.
    """
    if max_q_len <= 16:
        block_m, warps = 16, 4
    elif max_q_len <= 64 or head_dim > 128:
        block_m, warps = 64, 4
    else:
        block_m, warps = 128, 8
    return block_m, 64, warps


def launch_extend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_start: torch.Tensor,
                  q_len: torch.Tensor, kv_len: torch.Tensor, page_table: torch.Tensor, out: torch.Tensor, *,
                  scale: float, page_size: int, sliding_window: int, soft_cap: float, max_q_len: int,
                  block_m: int, block_n: int, num_warps: int, k_scale: float = 1.0, v_scale: float = 1.0,
                  tree_mask: torch.Tensor | None = None) -> None:
    """Launches the extend kernel on inputs the dispatcher has checked. ``max_q_len`` must bound every
    ``q_len[b]`` (rows past it would be left unwritten). ``tree_mask``: i32 per query row (attention.py)."""
    tokens, heads, head_dim = q.shape
    batch = q_len.shape[0]
    if tokens == 0 or batch == 0 or max_q_len == 0:
        return
    num_m_blocks = triton.cdiv(max_q_len, block_m)
    _extend_kernel[(num_m_blocks, heads, batch)](
        q, k_cache, v_cache, out, q_start, q_len, kv_len, page_table, q_len if tree_mask is None else tree_mask,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        page_table.stride(0), num_m_blocks, heads // k_cache.shape[1], head_dim, page_size, scale, soft_cap,
        sliding_window, k_scale, v_scale,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=pow2(head_dim, 16), SOFT_CAP=soft_cap > 0,
        SLIDING=sliding_window > 0, DOT_F32=dot_in_f32(q.dtype), KV_FP8=k_cache.dtype == torch.float8_e4m3fn,
        TREE=tree_mask is not None, num_warps=num_warps, num_stages=2)
