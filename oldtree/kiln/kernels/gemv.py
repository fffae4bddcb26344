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
``tl.dot`` (the broadcast product over a few rows, as one [rows, columns, K] product, measured 5-10x
slower on an H200; ``gemv_few_rows.py`` keeps an accumulator a row instead, for 2-8 rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .config import DEFAULTS, KernelConfig
from .triton_support import await_previous_kernel, dot_in_f32, pdl_launch, pow2, sm_count

# Where the GEMV runs: few rows, at most the 16 its tl.dot path pads them to. Above this the GEMM is
# compute-bound and cuBLAS is the better kernel.
GEMV_MAX_ROWS = 16

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


def gemv_config(rows: int, n: int, k: int, sms: int, config: KernelConfig = DEFAULTS) -> GemvConfig:
    """Tiles for ``rows`` (<= GEMV_MAX_ROWS) rows of output ``n`` columns wide over ``k``, within the
    bounds of ``config``'s ``gemv_*`` fields."""
    use_dot = rows > 1
    block_t = 16 if use_dot else 1
    least_n, most_n = config.gemv_block_n
    least_k, most_k = config.gemv_block_k
    if use_dot:
        least_n = 16
    else:
        most_n = min(most_n, config.gemv_product_elements // least_k)
    block_n = max(least_n, most_n)
    # The widest tile that still gives every SM its programs: wider tiles reload x less often.
    while block_n > least_n and triton.cdiv(n, block_n) < sms * config.gemv_programs_per_sm:
        block_n //= 2
    whole_k = pow2(k, 16)
    if use_dot:
        block_k = config.gemv_dot_block_k
    elif whole_k <= config.gemv_one_step_max_k and block_n * whole_k <= config.gemv_product_elements:
        block_k = whole_k
    else:
        block_k = max(least_k, min(most_k, config.gemv_product_elements // block_n))
    return GemvConfig(block_t, block_n, min(block_k, whole_k), use_dot)


@triton.jit
def tile_product(x, w, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr):
    # x: [BLOCK_T, BLOCK_K] in the activation dtype; w: [BLOCK_N, BLOCK_K]. Returns x @ w.T in f32.
    if USE_DOT:
        if DOT_F32:
            return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        return tl.dot(x, tl.trans(w))
    return tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def weight_tile(w_ptr, cols, N, w_st, k, K):
    # Columns at or past N (the last tile's padding) load nothing.
    w_mask = (cols < N)[:, None] & (k < K)[None, :]
    return tl.load(w_ptr + cols.to(tl.int64)[:, None] * w_st + k[None, :], mask=w_mask, other=0.0)


@triton.jit
def input_tile(x_rows, nw_ptr, row_mask, k, K, PROLOGUE: tl.constexpr):
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
def tile_input(xk, partner, rstd, PROLOGUE: tl.constexpr, dtype: tl.constexpr):
    if PROLOGUE == NORM:
        return _normalize(xk, rstd, partner, dtype)
    if PROLOGUE == SILU_MUL:
        return _silu_mul(xk, partner, dtype)
    return xk


@triton.jit
def row_rstd(x_rows, row_mask, K, eps, BLOCK_T: tl.constexpr, NORM_BLOCK_K: tl.constexpr):
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
    w = weight_tile(w_ptr, cols, N, w_st, offs_k, K)
    await_previous_kernel(PDL)
    xk, partner = input_tile(x_rows, nw_ptr, row_mask, offs_k, K, PROLOGUE)
    rstd = tl.zeros([BLOCK_T], tl.float32)
    if PROLOGUE == NORM:
        if ONE_TILE:  # x's only tile holds all of it
            xf = xk.to(tl.float32)
            rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / K + eps)
        else:
            rstd = row_rstd(x_rows, row_mask, K, eps, BLOCK_T, NORM_BLOCK_K)
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # The next step's loads first, so the memory never waits on the math (past K they load nothing).
        next_k = k0 + BLOCK_K + offs_k
        w_next = weight_tile(w_ptr, cols, N, w_st, next_k, K)
        x_next, partner_next = input_tile(x_rows, nw_ptr, row_mask, next_k, K, PROLOGUE)
        acc += tile_product(tile_input(xk, partner, rstd, PROLOGUE, dtype), w, USE_DOT, DOT_F32)
        w = w_next
        xk = x_next
        partner = partner_next
    gemv_epilogue(acc, b_ptr, r_ptr, y_ptr, rows, cols, row_mask, cols < N, r_st, y_st, dtype, HAS_BIAS, HAS_RESIDUAL)


@triton.jit
def gemv_epilogue(acc, b_ptr, r_ptr, y_ptr, rows, cols, row_mask, col_mask, r_st, y_st, dtype: tl.constexpr,
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
                eps: float = 0.0, config: KernelConfig = DEFAULTS) -> None:
    """``out = prologue(x) @ weight.T + bias + residual`` for checked operands, where the prologue is
    ``rmsnorm(x, norm_weight)`` when a norm weight is given, ``silu(gate) * up`` when ``gated`` (x's
    rows then hold [gate | up], twice weight's K), and x itself otherwise."""
    rows = x.shape[0]
    n, k = weight.shape
    if rows == 0 or n == 0:
        return
    prologue = NORM if norm_weight is not None else SILU_MUL if gated else RAW
    cfg = gemv_config(rows, n, k, sm_count(x), config)
    # Absent inputs are never read (their constexpr flag is off); any tensor stands in for the pointer.
    res = residual if residual is not None else out
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, norm_weight if norm_weight is not None else x, weight, bias if bias is not None else x, res, out,
        rows, n, k, eps, x.stride(0), weight.stride(0), res.stride(0), out.stride(0),
        PROLOGUE=prologue, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        USE_DOT=cfg.use_dot, DOT_F32=dot_in_f32(x.dtype), BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, ONE_TILE=cfg.block_k >= k,
        NORM_BLOCK_K=min(pow2(k, 16), max(16, config.gemv_norm_pass_elements // cfg.block_t)),
        num_warps=config.gemv_num_warps, num_stages=config.gemv_num_stages, **pdl_launch(x, config.pdl))
