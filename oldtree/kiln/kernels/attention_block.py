"""The inner step shared by the paged attention kernels: one block of keys against a tile of queries.

``attend_block`` gathers ``BLOCK_N`` consecutive context positions of one sequence through its page
table (position ``j`` lives at slot ``page_table[j // page_size] * page_size + j % page_size``), scores
them against the query tile, and folds them into the running online-softmax state (row max ``m``,
row sum ``l``, unnormalized output ``acc``), all in f32. Scores are kept in base-2 units (scaled by
log2(e)) so the exponentials are ``exp2``. Its two halves are separate functions (``load_kv_block``,
``fold_block``) so that decode can load a block before its query exists. An FP8 pool (``KV_FP8``)
is read back times its per-tensor scales (``from_fp8``); ``to_fp8`` is how the kernels that store
into one round.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_support import tanh

# Constexprs so that jitted code may read them (plain globals are refused inside kernels).
LOG2E = tl.constexpr(1.4426950408889634)
FP8_MAX = tl.constexpr(448.0)  # the largest finite float8 e4m3fn
ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: adding and subtracting it rounds an f32 to an integer
# A tree mask's row covers the last TREE_WINDOW keys of its sequence's context, a bit each (i32).
TREE_WINDOW_KEYS = 32
TREE_WINDOW = tl.constexpr(TREE_WINDOW_KEYS)


@triton.jit
def load_kv_block(k_base, v_base, page_row, n0, kv_end, slot_stride, page_size, offs_d, d_mask, k_scale, v_scale,
                  BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr, DTYPE: tl.constexpr):
    # The K and V tiles [BLOCK_N, BLOCK_D] of context positions n0 .. n0 + BLOCK_N (zeros at or past
    # kv_end), both issued before either is used, so their latencies overlap. An FP8 pool's tiles
    # come back as DTYPE (the query's), times their scales: the dots then run as with a plain pool.
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < kv_end
    page = tl.load(page_row + offs_n // page_size, mask=n_mask, other=0).to(tl.int64)
    slot = page * page_size + offs_n % page_size
    kv_offsets = slot[:, None] * slot_stride + offs_d[None, :]
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_base + kv_offsets, mask=kv_mask, other=0.0)
    v = tl.load(v_base + kv_offsets, mask=kv_mask, other=0.0)
    if KV_FP8:
        k = from_fp8(k, k_scale, DTYPE)
        v = from_fp8(v, v_scale, DTYPE)
    return k, v


@triton.jit
def to_fp8(x, scale, FP8: tl.constexpr):
    # x as an FP8 pool stores it: divided by its scale, saturated to e4m3's range, rounded to the
    # nearest e4m3 value (ties to even) here in f32, so that the cast itself is exact. On a GPU the
    # cast alone would round the same way; Triton's interpreter's cast does not carry a rounding into
    # the exponent (31.9 became 16), and the kernels are tested under it.
    y = tl.minimum(tl.maximum(x.to(tl.float32) / scale, -FP8_MAX), FP8_MAX)
    exponent = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    # e4m3 keeps 3 mantissa bits; below its smallest normal binade (2^-6) the step stays 2^-9.
    step = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magnitude = ((tl.abs(y) / step + ROUND_MAGIC) - ROUND_MAGIC) * step  # |y| / step < 16: exact, ties to even
    return tl.where(y < 0, -magnitude, magnitude).to(FP8)


@triton.jit
def from_fp8(x, scale, DTYPE: tl.constexpr):
    return (x.to(tl.float32) * scale).to(DTYPE)


@triton.jit
def fold_block(acc, m_i, l_i, q, q_pos, k, v, n0, kv_end, scale, soft_cap, window, tree_bits, tree_start,
               MASKED: tl.constexpr, SOFT_CAP: tl.constexpr, SLIDING: tl.constexpr, DOT_F32: tl.constexpr,
               BLOCK_N: tl.constexpr, TREE: tl.constexpr):
    # Folds the K/V tiles of positions n0 .. n0 + BLOCK_N (load_kv_block's) into the online-softmax
    # state of the query tile q: [BLOCK_M, BLOCK_D] (already f32 when DOT_F32); q_pos: [BLOCK_M] the
    # context position of each query row. Positions at or past kv_end count for nothing. MASKED
    # applies the causal (and window) condition per score; callers leave it off for blocks wholly
    # before every query of the tile. TREE (a draft tree's mask): a key at context position
    # ``tree_start + j`` (j < TREE_WINDOW) counts only where bit j of the row's ``tree_bits`` is set.
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < kv_end
    if DOT_F32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if SOFT_CAP:
        s = soft_cap * LOG2E * tanh(s * (scale / soft_cap))
    else:
        s = s * (scale * LOG2E)
    if MASKED:
        allowed = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if SLIDING:
            allowed = allowed & (offs_n[None, :] > q_pos[:, None] - window)
        if TREE:
            bit = tl.minimum(tl.maximum(offs_n - tree_start, 0), TREE_WINDOW - 1)
            in_tree = (offs_n >= tree_start)[None, :]
            allowed = allowed & (~in_tree | (((tree_bits[:, None] >> bit[None, :]) & 1) != 0))
        s = tl.where(allowed, s, float("-inf"))
    # m_i starts finite (-1e30), so a row whose scores are all masked keeps p = 0 and alpha = 1
    # instead of computing -inf - -inf.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # The probabilities go into the second product in V's dtype (tensor cores on the GPU); under
    # DOT_F32 they are still rounded to it so both paths compute the same thing.
    p = p.to(v.dtype)
    if DOT_F32:
        pv = tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p, v)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def attend_block(acc, m_i, l_i, q, q_pos, k_base, v_base, page_row, n0, kv_end, slot_stride, page_size,
                 offs_d, d_mask, scale, soft_cap, window, k_scale, v_scale, tree_bits, tree_start,
                 MASKED: tl.constexpr, SOFT_CAP: tl.constexpr, SLIDING: tl.constexpr, DOT_F32: tl.constexpr,
                 BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr, DTYPE: tl.constexpr, TREE: tl.constexpr):
    # load_kv_block then fold_block: positions n0 .. n0 + BLOCK_N (keys at or past kv_end are never read).
    k, v = load_kv_block(k_base, v_base, page_row, n0, kv_end, slot_stride, page_size, offs_d, d_mask, k_scale,
                         v_scale, BLOCK_N, KV_FP8, DTYPE)
    return fold_block(acc, m_i, l_i, q, q_pos, k, v, n0, kv_end, scale, soft_cap, window, tree_bits, tree_start,
                      MASKED=MASKED, SOFT_CAP=SOFT_CAP, SLIDING=SLIDING, DOT_F32=DOT_F32, BLOCK_N=BLOCK_N, TREE=TREE)
