"""Merging split-KV decode attention inside the launch that computed the splits.

Each split's program stores its f32 partial output and its base-2 log-sum-exp per query head, then
takes a ticket from its (sequence, KV group) counter; the program that draws the last ticket merges
the group's splits into the output and puts the counter back to zero. Only the splits that hold keys
take part (``used`` of them, the leading ones): a short context in a launch sized for the longest one
leaves most splits empty, and their programs return before storing anything, so the merge reads
only the partials there are (at batch 1 on an H200, 4 of Llama-3-8B's 33 at 256 tokens). A decode step is launch-bound
at small batch (a CUDA-graph replay pays a few microseconds per kernel, every layer), so this serial
fix-up replaces a second, merging launch. The counters are the device's shared semaphore counters
(``triton_support.semaphore_counters``, whose docstring says why kernels in one stream can share
them).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .config import KernelConfig


def splits_merged_at_once(block_h: int, block_d: int, config: KernelConfig) -> int:
    """How many splits the merge reads per step for a group of ``block_h`` heads of ``block_d``: a
    tile of ``config.decode_merge_tile`` partials."""
    return max(1, config.decode_merge_tile // (block_h * block_d))


@triton.jit
def _merge_splits(part_o_ptr, part_lse_ptr, out_ptr, b, kv_head, row, o_st, o_sh, num_heads, group, head_dim,
                  num_splits, used, BLOCK_H: tl.constexpr, MERGE_S: tl.constexpr, BLOCK_D: tl.constexpr):
    # out = sum_s w_s o_s / sum_s w_s over the first `used` splits of each query head of the group, with
    # w_s = 2^(lse_s - max lse), the softmax over the splits' log-sum-exps. Splits come MERGE_S at a
    # time, so the max is a running one (m starts finite, as in attend_block, so that the -inf lse
    # of a padded head weighs exactly 0 instead of making -inf - -inf).
    h = tl.arange(0, BLOCK_H)
    h_mask = h < group
    heads = kv_head * group + h
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    first = (b.to(tl.int64) * num_heads + heads) * num_splits
    m = tl.full([BLOCK_H], -1.0e30, tl.float32)
    den = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s0 in range(0, used, MERGE_S):
        s = s0 + tl.arange(0, MERGE_S)
        hs_mask = h_mask[:, None] & (s < used)[None, :]
        part = first[:, None] + s[None, :]
        # .cg reads L2, where the other programs' partials are, never a stale L1 line.
        lse = tl.load(part_lse_ptr + part, mask=hs_mask, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(part_o_ptr + part[:, :, None] * head_dim + offs_d[None, None, :],
                    mask=hs_mask[:, :, None] & d_mask[None, None, :], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, 1))
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new[:, None])
        den = den * alpha + tl.sum(w, 1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 1)
        m = m_new
    # Split 0 of a sequence is never empty, so den > 0 for every real head; padded heads are not stored.
    out = acc / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(out_ptr + row * o_st + heads[:, None] * o_sh + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=h_mask[:, None] & d_mask[None, :])


@triton.jit
def store_split_and_merge(out, m_i, l_i, part_o_ptr, part_lse_ptr, counter_ptr, out_ptr, b, kv_head, split, row,
                          heads, g_mask, offs_d, mask, o_st, o_sh, num_heads, group, head_dim, num_splits, used,
                          BLOCK_H: tl.constexpr, MERGE_S: tl.constexpr, BLOCK_D: tl.constexpr):
    # One split's normalized output `out` [BLOCK_G, BLOCK_D] for query heads `heads` (rows of g_mask
    # are real), with its online-softmax row max m_i and row sum l_i (base 2), goes to the partials;
    # the group's last split to finish writes output row `row` of sequence b. `used` is how many
    # splits (the leading ones) take part; the others never call this.
    # Partials are [B, heads, splits, head_dim] and [B, heads, splits]; the lse is in base 2.
    part = (b.to(tl.int64) * num_heads + heads) * num_splits + split
    tl.store(part_o_ptr + part[:, None] * head_dim + offs_d[None, :], out, mask=mask)
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    tl.store(part_lse_ptr + part, lse, mask=g_mask)
    # Why the last ticket sees every split's partials on a GPU:
    # - Release: the barrier orders the stores of all this program's threads before the
    #   atomic, which one thread issues (Triton predicates a scalar atomic to a single thread);
    #   its gpu-scope release is cumulative, so it publishes the whole CTA's partials (the
    #   pattern of cooperative groups' grid sync: bar.sync, then one thread's fence + atomic).
    # - Acquire: the tickets form one release sequence of read-modify-writes, so the atomic that
    #   returns used - 1 reads from, and synchronizes with, every other split's release.
    #   Triton hands a scalar atomic's result to all threads through shared memory behind a
    #   barrier, so every thread of the merging program sees the same ticket (the branch below,
    #   whose reductions use barriers, is uniform) and reads after the acquire; the merge's
    #   loads also go to L2 (.cg).
    # - Reset: every used split has taken its ticket by then and none touches the counter again in
    #   this launch; the next launch (the next layer, or the next graph replay) is ordered after
    #   this one by the stream.
    tl.debug_barrier()
    counter = counter_ptr + b * tl.num_programs(1) + kv_head
    ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if ticket == used - 1:
        _merge_splits(part_o_ptr, part_lse_ptr, out_ptr, b, kv_head, row, o_st, o_sh, num_heads, group,
                      head_dim, num_splits, used, BLOCK_H=BLOCK_H, MERGE_S=MERGE_S, BLOCK_D=BLOCK_D)
        tl.store(counter, 0)
