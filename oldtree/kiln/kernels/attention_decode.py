"""Paged attention for decode steps (every sequence has at most one new token): split-KV flash decoding
in one launch.

Grid ``(sequences, kv_heads, splits)``: program ``(b, g, s)`` takes the ``s``-th of ``splits`` equal
slices of sequence ``b``'s context and attends *all* query heads of KV group ``g`` to it at once, so
each K/V entry is read from memory once per step (the query heads form the rows of one tile, padded
to 16 for the tensor cores). With one split the program writes the output itself. With several,
the group's last split to finish merges them in the same launch (``attention_split_merge``).
The split count is a runtime argument (not a compile-time constant) so that batches of every size
share one compiled kernel.

Splitting a long context is what keeps the GPU busy at small batch (B * kv_heads programs alone
would leave most SMs idle); how many splits is a host-side choice (``decode_splits``) that never
changes the result, so a CUDA graph captured with one split count stays correct for any lengths.

With ``new_tokens`` (the fused ``rope_kv_attention``) the step's q, k and v arrive unrotated, and
the rotary embedding and the KV store happen here instead of in a kernel of their own: every
program rotates its group's query heads in registers, and the program whose slice holds the new
token (the context's last position) rotates its k and writes k and v to the token's pool slot before
its loop reads them back. A decode step then runs one launch per layer fewer. And since the kernel
before stores nothing in the pool, each program may load its first key block before waiting for
that kernel (under PDL, while it still runs): at batch 1 that is the whole cached context, so what
is left after the wait is q, one block's arithmetic and the merge. It pays only while the whole
grid is resident at once (``preloads_first_block``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .attention_block import attend_block, fold_block, from_fp8, load_kv_block, to_fp8
from .attention_split_merge import splits_merged_at_once, store_split_and_merge
from .config import DEFAULTS, KernelConfig
from .triton_support import await_previous_kernel, dot_in_f32, pdl_launch, pow2, semaphore_counters, sm_count

@dataclass(frozen=True)
class NewTokens:
    """The decode step's unrotated k and v ``[T, kv_heads, head_dim]`` with what rotating and storing
    them takes: positions ``[T]``, the ``[max_pos, rot]`` cos/sin table and pool slots ``[T]``."""
    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    cos_sin: torch.Tensor
    slots: torch.Tensor


@triton.jit
def _rotated(x_ptrs, d, mask, cs_row, half, rot, dtype: tl.constexpr):
    # The rotary embedding of the elements x_ptrs points at (dims d of some rows), rounded as
    # ref_rope computes it in the tensor dtype: each product rounded, then their sum. Dims past
    # `rot` pass through (cos 1, sin 0 leave them exact).
    partner = tl.where(d < half, d + half, tl.where(d < rot, d - half, d))
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(x_ptrs + (partner - d), mask=mask, other=0.0).to(tl.float32)
    j = tl.where(d < half, d, d - half)
    rotated = d < rot
    cos = tl.load(cs_row + j, mask=rotated, other=1.0).to(dtype).to(tl.float32)
    sin = tl.load(cs_row + half + j, mask=rotated, other=0.0).to(dtype).to(tl.float32)
    sign = tl.where(d < half, -1.0, 1.0)
    return ((x * cos).to(dtype).to(tl.float32) + sign * (x_partner * sin).to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _with_new_token(tile, row, n0, pos, BLOCK_N: tl.constexpr):
    # The [BLOCK_N, BLOCK_D] K or V tile of positions n0 .. n0 + BLOCK_N with position pos's row
    # replaced by `row` (a tile without that position is returned as it is).
    here = (n0 + tl.arange(0, BLOCK_N)) == pos
    return tl.where(here[:, None], row.to(tile.dtype)[None, :], tile)


@triton.jit
def _decode_kernel(q_ptr, kc_ptr, vc_ptr, out_ptr, part_o_ptr, part_lse_ptr, counter_ptr,
                   q_start_ptr, q_len_ptr, kv_len_ptr, pt_ptr,
                   k_ptr, v_ptr, pos_ptr, cs_ptr, slot_ptr, k_st, k_sh, v_st, v_sh, rot,
                   q_st, q_sh, o_st, o_sh, slot_stride, head_stride, pt_stride,
                   num_heads, group, head_dim, page_size, scale, soft_cap, window, num_splits, k_scale, v_scale,
                   ROPE: tl.constexpr, SPLIT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_H: tl.constexpr,
                   MERGE_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   SOFT_CAP: tl.constexpr, SLIDING: tl.constexpr, DOT_F32: tl.constexpr, PRELOAD: tl.constexpr,
                   KV_FP8: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Every split of a padding row returns here, so none of them takes a ticket and the row's
    # counters stay at zero.
    if tl.load(q_len_ptr + b) == 0:
        return
    q_start = tl.load(q_start_ptr + b).to(tl.int64)
    kv_len = tl.load(kv_len_ptr + b)
    # The one query sits at position kv_len - 1; a window keeps keys j > kv_len - 1 - window.
    if SLIDING:
        lo = tl.maximum(kv_len - window, 0)
    else:
        lo = 0
    # Splits are whole key blocks; trailing splits of a short context may be empty, and then return
    # at once: only the `used` leading ones take part in the merge.
    per_split = tl.cdiv(tl.cdiv(kv_len - lo, num_splits), BLOCK_N) * BLOCK_N
    used = tl.cdiv(kv_len - lo, per_split)
    if split >= used:
        return
    start = lo + split * per_split
    end = tl.minimum(start + per_split, kv_len)

    g = tl.arange(0, BLOCK_G)
    g_mask = g < group
    heads = kv_head * group + g
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    mask = g_mask[:, None] & d_mask[None, :]
    q_ptrs = q_ptr + q_start * q_st + heads[:, None] * q_sh + offs_d[None, :]
    k_base = kc_ptr + kv_head.to(tl.int64) * head_stride
    v_base = vc_ptr + kv_head.to(tl.int64) * head_stride
    page_row = pt_ptr + b.to(tl.int64) * pt_stride
    # The context's last position holds the step's new token.
    new_pos = kv_len - 1
    if ROPE:
        half = rot // 2
        cs_row = cs_ptr + tl.load(pos_ptr + q_start).to(tl.int64) * rot
        slot = tl.load(slot_ptr + q_start).to(tl.int64)
    if PRELOAD:
        # The slice's first key block (PRELOAD comes only with ROPE). The kernel before this one
        # stores nothing in the pool (this kernel stores the new token itself), so every cached
        # position is final: under PDL the block loads while that kernel is still running, off the
        # critical path. The new token's row is stale here; _with_new_token puts it in below.
        k_first, v_first = load_kv_block(k_base, v_base, page_row, start, end, slot_stride, page_size, offs_d,
                                         d_mask, k_scale, v_scale, BLOCK_N, KV_FP8, q_ptr.dtype.element_ty)
    # Up to here the program read only the step's inputs (copied in before the step's first kernel
    # started), constants and (PRELOAD) the cached KV, so under PDL it did so while the kernel before
    # it was still running. q, the new k and v, and (without ROPE) the new token the previous kernel
    # stored come after the wait.
    await_previous_kernel(PDL)
    if ROPE:
        dtype = q_ptr.dtype.element_ty
        q = _rotated(q_ptrs, offs_d[None, :], mask, cs_row, half, rot, dtype)
        # The program whose slice holds the new token (a padded row of a decode graph, slot < 0,
        # has none: it stores nothing and attends to the pool as it is) rotates its k and stores k
        # and v in the pool, where its loop reads them back: bar.sync makes a CTA's global stores
        # visible to all of its threads. No other program reads that slot (other splits cover other
        # positions, other groups other heads), and for them these loads are masked off.
        holds = (slot >= 0) & ((new_pos - lo) // per_split == split)
        k_new = _rotated(k_ptr + q_start * k_st + kv_head * k_sh + offs_d, offs_d, d_mask & holds, cs_row, half,
                         rot, dtype)
        v_new = tl.load(v_ptr + q_start * v_st + kv_head * v_sh + offs_d, mask=d_mask & holds)
        if KV_FP8:
            # The pool holds them rounded to FP8; the preloaded block takes them as the pool reads back.
            k_stored = to_fp8(k_new, k_scale, kc_ptr.dtype.element_ty)
            v_stored = to_fp8(v_new, v_scale, vc_ptr.dtype.element_ty)
            k_new = from_fp8(k_stored, k_scale, dtype)
            v_new = from_fp8(v_stored, v_scale, dtype)
        else:
            k_stored = k_new
            v_stored = v_new
        if holds:
            tl.store(kc_ptr + slot * slot_stride + kv_head * head_stride + offs_d, k_stored, mask=d_mask)
            tl.store(vc_ptr + slot * slot_stride + kv_head * head_stride + offs_d, v_stored, mask=d_mask)
            tl.debug_barrier()
    else:
        q = tl.load(q_ptrs, mask=mask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    q_pos = tl.zeros([BLOCK_G], tl.int32) + new_pos

    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    # Every key in [start, end) is causally visible and inside the window; MASKED only cuts the
    # block at `end`.
    loop_start = start
    if PRELOAD:
        # The preloaded block predates the store: the new token (position -1, in no block, for a
        # program that stored nothing) goes in from registers. The loop's blocks go from the pool
        # to the dots untouched: the same replacement there takes each pipelined tile out of shared
        # memory into registers and back (sm_90 TTGIR: 9 shared buffers against 4), and made the
        # kernel slower on an H200 (SmolLM2 at batch 64: 12.2 -> 14.1 us a layer).
        stored_pos = tl.where(holds, new_pos, -1)
        k_first = _with_new_token(k_first, k_new, start, stored_pos, BLOCK_N)
        v_first = _with_new_token(v_first, v_new, start, stored_pos, BLOCK_N)
        acc, m_i, l_i = fold_block(acc, m_i, l_i, q, q_pos, k_first, v_first, start, end, scale, soft_cap, window,
                                   0, 0, MASKED=True, SOFT_CAP=SOFT_CAP, SLIDING=False, DOT_F32=DOT_F32,
                                   BLOCK_N=BLOCK_N, TREE=False)
        loop_start = start + BLOCK_N
    for n0 in range(loop_start, end, BLOCK_N):
        acc, m_i, l_i = attend_block(acc, m_i, l_i, q, q_pos, k_base, v_base, page_row, n0, end, slot_stride,
                                     page_size, offs_d, d_mask, scale, soft_cap, window, k_scale, v_scale, 0, 0,
                                     MASKED=True, SOFT_CAP=SOFT_CAP, SLIDING=False, DOT_F32=DOT_F32, BLOCK_N=BLOCK_N,
                                     KV_FP8=KV_FP8, DTYPE=q_ptr.dtype.element_ty, TREE=False)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SPLIT:
        store_split_and_merge(out, m_i, l_i, part_o_ptr, part_lse_ptr, counter_ptr, out_ptr, b, kv_head, split,
                              q_start, heads, g_mask, offs_d, mask, o_st, o_sh, num_heads, group, head_dim,
                              num_splits, used, BLOCK_H=BLOCK_H, MERGE_S=MERGE_S, BLOCK_D=BLOCK_D)
    else:
        tl.store(out_ptr + q_start * o_st + heads[:, None] * o_sh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask)


def decode_splits(batch: int, kv_heads: int, kv_bound: int, sm_count: int, config: KernelConfig = DEFAULTS) -> int:
    """How many slices to cut each context into: enough programs for about
    ``config.decode_split_programs_per_sm`` an SM, but no slice under ``decode_min_split_tokens`` of
    the longest possible context ``kv_bound``."""
    wanted = triton.cdiv(config.decode_split_programs_per_sm * sm_count, max(1, batch * kv_heads))
    most = triton.cdiv(max(kv_bound, 1), config.decode_min_split_tokens)
    return max(1, min(wanted, most, config.decode_max_splits))


def preloads_first_block(programs: int, sm_count: int, config: KernelConfig = DEFAULTS) -> bool:
    """Whether each program of a grid of ``programs`` loads its first key block before the PDL wait:
    only when all of them are resident at once, so every one of them starts under the kernel before."""
    return programs <= config.decode_preload_max_programs_per_sm * sm_count


def launch_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_start: torch.Tensor,
                  q_len: torch.Tensor, kv_len: torch.Tensor, page_table: torch.Tensor, out: torch.Tensor, *,
                  scale: float, page_size: int, sliding_window: int, soft_cap: float, num_splits: int,
                  new_tokens: NewTokens | None = None, config: KernelConfig = DEFAULTS, k_scale: float = 1.0,
                  v_scale: float = 1.0) -> None:
    """Launches decode attention on inputs the dispatcher has checked; every ``q_len[b]`` must be 0 or 1.
    With ``new_tokens``, ``q`` is unrotated and the kernel rotates it and stores the new k and v
    first; then every token with a pool slot must be the query of a sequence (``q_start[b]`` with
    ``q_len[b] = 1``), as in every decode step, since only those are stored. Block size, warps,
    stages and the preload's bound come from ``config``'s ``decode_*`` fields."""
    tokens, heads, head_dim = q.shape
    batch, kv_heads = q_len.shape[0], k_cache.shape[1]
    if tokens == 0 or batch == 0:
        return
    group = heads // kv_heads
    block_d = pow2(head_dim, 16)
    block_h = pow2(group)
    if num_splits > 1:
        part_o = torch.empty((batch, heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, heads, num_splits), dtype=torch.float32, device=q.device)
        counters = semaphore_counters(q.device, batch * kv_heads)
    else:
        # Never touched with one split (the kernel writes `out` directly); any tensor will do.
        part_o = part_lse = counters = out.new_empty(0, dtype=torch.float32)
    new = new_tokens
    # Without new tokens their pointers are never read (ROPE is off); q stands in for each.
    rope_args = (new.k, new.v, new.positions, new.cos_sin, new.slots, new.k.stride(0), new.k.stride(1),
                 new.v.stride(0), new.v.stride(1), new.cos_sin.shape[1]) if new else (q, q, q, q, q, 0, 0, 0, 0, 0)
    _decode_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_o, part_lse, counters, q_start, q_len, kv_len, page_table, *rope_args,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        page_table.stride(0), heads, group, head_dim, page_size, scale, soft_cap, sliding_window, num_splits,
        k_scale, v_scale, ROPE=new is not None, SPLIT=num_splits > 1, BLOCK_G=pow2(group, 16), BLOCK_H=block_h,
        MERGE_S=min(config.decode_max_splits, splits_merged_at_once(block_h, block_d, config)),
        BLOCK_N=config.decode_block_n,
        BLOCK_D=block_d, SOFT_CAP=soft_cap > 0, SLIDING=sliding_window > 0, DOT_F32=dot_in_f32(q.dtype),
        PRELOAD=new is not None and preloads_first_block(batch * kv_heads * num_splits, sm_count(q), config),
        KV_FP8=k_cache.dtype == torch.float8_e4m3fn,
        num_warps=config.decode_num_warps, num_stages=config.decode_num_stages,
        # With the rotation, an fma would skip the rounding of a product to the dtype that ref_rope does.
        enable_fp_fusion=new is None, **pdl_launch(q, config.pdl))
