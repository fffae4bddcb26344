"""The decode GEMV: ``y = epilogue(prologue(x) @ W.T)`` for a few rows of x, one launch that streams W once.

Decode multiplies one token per sequence by every weight matrix, so each GEMM is a read of the
weights with almost no arithmetic: its time is the weight bytes over the memory bandwidth, plus the
kernel's ramp-up and tail. This kernel owns that stream for ``linear_fused``'s three ops. It applies
the RMSNorm or the SiLU gate to the tiny input (a prologue), and the bias or residual add to the
accumulator (an epilogue), so the norm and activation kernels around a cuBLAS call disappear.

How it keeps the memory busy:
- Each program owns ``BLOCK_N`` output columns (weight rows) and walks K in tiles of ``BLOCK_K``,
  loading tile i+1 before it multiplies tile i, so one tile is always in flight while it computes.
- The first tile is loaded before ``await_previous_kernel``: weights are never written during a
  step, so under programmatic dependent launch their fetch overlaps the previous kernel's tail.
- No split-K: every output is one program's sum in one fixed order, so results are deterministic
  and round as a plain GEMM would. Tiles are sized so that every SM still gets its programs.
- One program per column tile. A persistent variant (a program per resident slot, streaming its
  tiles as one pipelined sequence) measured slower on an H200 at Llama-3-8B's shapes: a layer's
  chain of four GEMVs took 157 us against 127 us, each GEMV alone 1-6 us slower except gate/up.

Rows: one row multiplies and sums in registers (a broadcast product); 2-16 rows pad to 16 for
``tl.dot`` (the broadcast product over a few rows measured 5-10x slower on an H200).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_support import await_previous_kernel, dot_in_f32, pdl_launch, pow2, sm_count

# Where the GEMV runs: few rows. Above this the GEMM is compute-bound and cuBLAS is the better kernel.
GEMV_MAX_ROWS = 16
# Tiling knobs of gemv_config (module constants so that bench/step_breakdown.py --set can sweep them).
GEMV_PROGRAMS_PER_SM = 2  # at least this many column tiles per SM, so every SM streams
GEMV_BLOCK_N = (4, 8)  # least and most weight rows (output columns) per tile
GEMV_BLOCK_K = (64, 1024)  # least and most of K per tile; contiguous runs that load as wide vectors
# A one-row tile holds this many weights: 128 a
# thread at 4 warps, twice that with the next tile in flight beside it. Measured on an H200 at
# Llama-3-8B's shapes: tiles of 8192 weights streamed at 2.4-3.4 TB/s, tiles of 16384 at 3.2-3.9.
GEMV_PRODUCT_ELEMENTS = 16384
GEMV_DOT_BLOCK_K = 128  # the tl.dot path steps through K by this much
# Up to this K a one-row program takes all of K in one tile, so all its loads are in flight at once
# and x is read once. Measured on an H200 at SmolLM2's shapes: 1.5-2.8 us a GEMV, against 2.5-4.7 us
# stepping through K.
GEMV_ONE_STEP_MAX_K = 2048
GEMV_NUM_WARPS = 4
GEMV_NUM_STAGES = 1  # the loop pipelines its weight tiles in registers itself
# The norm's first pass over x reads this many elements at a time (all rows together).
NORM_PASS_ELEMENTS = 4096

# Prologue kinds (what the GEMM's input is made from); constexprs so that the kernel may read them.
RAW = tl.constexpr(0)
NORM = tl.constexpr(1)  # rmsnorm(x, norm_weight)
SILU_MUL = tl.constexpr(2)  # x's rows hold [gate | up], 2K wide: silu(gate) * up


@dataclass(frozen=True)
class GemvConfig:
    """The tiles of one GEMV launch: padded rows, output columns per program, K per step."""
    block_t: int
    block_n: int
    block_k: int
    use_dot: bool


def gemv_config(rows: int, n: int, k: int, sms: int) -> GemvConfig:
    """Tiles for ``rows`` (<= GEMV_MAX_ROWS) rows of output ``n`` columns wide over ``k``."""
    use_dot = rows > 1
    block_t = 16 if use_dot else 1
    least_n = 16 if use_dot else GEMV_BLOCK_N[0]
    most_n = GEMV_BLOCK_N[1] if use_dot else GEMV_PRODUCT_ELEMENTS // GEMV_BLOCK_K[0]
    block_n = max(least_n, min(GEMV_BLOCK_N[1], most_n))
    # The widest tile that still gives every SM its programs: wider tiles reload x less often.
    while block_n > least_n and triton.cdiv(n, block_n) < sms * GEMV_PROGRAMS_PER_SM:
        block_n //= 2
    whole_k = pow2(k, 16)
    if use_dot:
        # Measured on an H200: all of K in one tl.dot step (its operands in shared memory) ran 3-10x
        # slower than stepping through K.
        block_k = GEMV_DOT_BLOCK_K
    elif whole_k <= GEMV_ONE_STEP_MAX_K and block_n * whole_k <= GEMV_PRODUCT_ELEMENTS:
        block_k = whole_k
    else:
        block_k = max(GEMV_BLOCK_K[0], min(GEMV_BLOCK_K[1], GEMV_PRODUCT_ELEMENTS // block_n))
    return GemvConfig(block_t, block_n, min(block_k, whole_k), use_dot)


@triton.jit
def _tile_product(x, w, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr):
    # x: [BLOCK_T, BLOCK_K] in the activation dtype; w: [BLOCK_N, BLOCK_K]. Returns x @ w.T in f32.
    if USE_DOT:
        if DOT_F32:
            return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        return tl.dot(x, tl.trans(w))
    return tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _weight_tile(w_ptr, cols, N, w_st, k, K):
    # Columns at or past N (the last tile's padding) load nothing.
    w_mask = (cols < N)[:, None] & (k < K)[None, :]
    return tl.load(w_ptr + cols.to(tl.int64)[:, None] * w_st + k[None, :], mask=w_mask, other=0.0)


@triton.jit
def _input_tile(x_rows, nw_ptr, row_mask, k, K, PROLOGUE: tl.constexpr):
    # x's tile as loaded and its partner beside it: the norm weight's tile (NORM) or the up half's
    # (SILU_MUL, K columns to the right). Combined only when used, so that the loads have a whole
    # tile's arithmetic to land.
    k_mask = k < K
    mask = row_mask[:, None] & k_mask[None, :]
    xk = tl.load(x_rows + k[None, :], mask=mask, other=0.0)
    if PROLOGUE == NORM:
        partner = tl.load(nw_ptr + k, mask=k_mask, other=0.0)
    elif PROLOGUE == SILU_MUL:
        partner = tl.load(x_rows + K + k[None, :], mask=mask, other=0.0)
    else:
        partner = xk
    return xk, partner


@triton.jit
def _normalize(xk, rstd, nw, dtype: tl.constexpr):
    # As ref_rmsnorm: normalize in f32, round, scale by the weight, round again.
    normed = (xk.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)
    return (normed * nw.to(tl.float32)[None, :]).to(dtype)


@triton.jit
def _silu_mul(gate, up, dtype: tl.constexpr):
    # As triton_silu_mul: silu(gate) rounded to the dtype before the multiply, the product rounded.
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return (silu * up.to(tl.float32)).to(dtype)


@triton.jit
def _tile_input(xk, partner, rstd, PROLOGUE: tl.constexpr, dtype: tl.constexpr):
    if PROLOGUE == NORM:
        return _normalize(xk, rstd, partner, dtype)
    if PROLOGUE == SILU_MUL:
        return _silu_mul(xk, partner, dtype)
    return xk


@triton.jit
def _row_rstd(x_rows, row_mask, K, eps, BLOCK_T: tl.constexpr, NORM_BLOCK_K: tl.constexpr):
    # Each program finds the rows' rstd itself: x is a few KB (read from L2), and one launch beats two.
    offs = tl.arange(0, NORM_BLOCK_K)
    sum_sq = tl.zeros([BLOCK_T], tl.float32)
    for k0 in range(0, K, NORM_BLOCK_K):
        k = k0 + offs
        xk = tl.load(x_rows + k[None, :], mask=row_mask[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
        sum_sq += tl.sum(xk * xk, axis=1)
    return tl.math.rsqrt(sum_sq / K + eps)


@triton.jit
def _gemv_kernel(x_ptr, nw_ptr, w_ptr, b_ptr, r_ptr, y_ptr, T, N, K, eps, x_st, w_st, r_st, y_st,
                 PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 USE_DOT: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, ONE_TILE: tl.constexpr, NORM_BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    # Program p computes output columns p*BLOCK_N .. +BLOCK_N of every row, stepping through K; step
    # i+1's loads go out before step i's arithmetic.
    dtype = y_ptr.dtype.element_ty
    rows = tl.arange(0, BLOCK_T)
    row_mask = rows < T
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_st
    # The first weight tile goes out before the wait; x is written by the kernel before, so after it.
    w = _weight_tile(w_ptr, cols, N, w_st, offs_k, K)
    await_previous_kernel(PDL)
    xk, partner = _input_tile(x_rows, nw_ptr, row_mask, offs_k, K, PROLOGUE)
    rstd = tl.zeros([BLOCK_T], tl.float32)
    if PROLOGUE == NORM:
        if ONE_TILE:  # x's only tile holds all of it
            xf = xk.to(tl.float32)
            rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / K + eps)
        else:
            rstd = _row_rstd(x_rows, row_mask, K, eps, BLOCK_T, NORM_BLOCK_K)
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # The next step's loads first, so the memory never waits on the math (past K they load nothing).
        next_k = k0 + BLOCK_K + offs_k
        w_next = _weight_tile(w_ptr, cols, N, w_st, next_k, K)
        x_next, partner_next = _input_tile(x_rows, nw_ptr, row_mask, next_k, K, PROLOGUE)
        acc += _tile_product(_tile_input(xk, partner, rstd, PROLOGUE, dtype), w, USE_DOT, DOT_F32)
        w = w_next
        xk = x_next
        partner = partner_next
    _epilogue(acc, b_ptr, r_ptr, y_ptr, rows, cols, row_mask, cols < N, r_st, y_st, dtype, HAS_BIAS, HAS_RESIDUAL)


@triton.jit
def _epilogue(acc, b_ptr, r_ptr, y_ptr, rows, cols, row_mask, col_mask, r_st, y_st, dtype: tl.constexpr,
              HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    if HAS_BIAS:
        # cuBLAS adds the bias to the f32 accumulator and rounds once; so does this.
        acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_mask = row_mask[:, None] & col_mask[None, :]
    if HAS_RESIDUAL:
        # The unfused graph rounds the GEMM's output before the add.
        r = tl.load(r_ptr + rows.to(tl.int64)[:, None] * r_st + cols[None, :], mask=out_mask, other=0.0)
        acc = acc.to(dtype).to(tl.float32) + r.to(tl.float32)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * y_st + cols[None, :], acc.to(dtype), mask=out_mask)


def launch_gemv(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
                gated: bool = False, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                eps: float = 0.0) -> None:
    """``out = prologue(x) @ weight.T + bias + residual`` for checked operands, where the prologue is
    ``rmsnorm(x, norm_weight)`` when a norm weight is given, ``silu(gate) * up`` when ``gated`` (x's
    rows then hold [gate | up], twice weight's K), and x itself otherwise."""
    rows = x.shape[0]
    n, k = weight.shape
    if rows == 0 or n == 0:
        return
    prologue = NORM if norm_weight is not None else SILU_MUL if gated else RAW
    cfg = gemv_config(rows, n, k, sm_count(x))
    # Absent inputs are never read (their constexpr flag is off); any tensor stands in for the pointer.
    res = residual if residual is not None else out
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, norm_weight if norm_weight is not None else x, weight, bias if bias is not None else x, res, out,
        rows, n, k, eps, x.stride(0), weight.stride(0), res.stride(0), out.stride(0),
        PROLOGUE=prologue, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        USE_DOT=cfg.use_dot, DOT_F32=dot_in_f32(x.dtype), BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, ONE_TILE=cfg.block_k >= k,
        NORM_BLOCK_K=min(pow2(k, 16), max(16, NORM_PASS_ELEMENTS // cfg.block_t)),
        num_warps=GEMV_NUM_WARPS, num_stages=GEMV_NUM_STAGES, **pdl_launch(x))
