"""The few-row GEMV: ``gemv.py``'s fused GEMV for 2 to ``KernelConfig.gemv_few_rows_max`` rows of x,
one pass over the weight by broadcast products instead of ``tl.dot``.

A speculative verify step brings each sequence's token and its drafts (5 or 9 rows at one sequence),
and small decode batches bring a few rows: the GEMM is still a read of the weight with a few flops a
value (2 a row), so it should cost what the one-row GEMV costs. ``gemv.py`` pads 2-16 rows to 16 for
``tl.dot``, which sends the weight tile through shared memory for the MMA (Llama-3-8B's layer at 5
rows: 51% of the copy rate on an H100, cuBLAS 86%, the one-row GEMV 96%). Here, as in the quantized
one-row GEMV (``gemv_quantized_row``):

- each row of x takes the weight tile's layout: each thread loads VEC values (16 bytes) of the row
  and the VEC weights of each weight row they multiply, every thread along K, so the loop moves
  nothing between threads;
- each thread sums its VEC products of a row into that row's accumulator [BLOCK_N, BLOCK_K / VEC]
  (a multiply and VEC - 1 fused multiply-adds), reduced across threads once, after the loop; the
  rows' accumulators are separate tensors (up to 8, written out by hand; see the kernel), never one
  [rows, ...] tensor whose layout Triton could spread across threads;
- the weight tile for the next K step is requested before this step's arithmetic.

The RMSNorm prologue and the bias or residual epilogue are ``gemv.py``'s helpers, so the result rounds
where the one-row GEMV's does; only the order of the f32 sums differs. The SiLU·mul prologue is the
elementwise kernel's, run first: recomputed for every row in every program it would cost more
instructions than the weight stream leaves. Cost, from sm_90 compiles of Llama-3-8B's layer GEMVs at
bf16 (instructions of the main loop a weight; the one-row GEMV streams at ~6.4 weights a clock per
SM on an H100, against 128 instructions issued): 2 rows 5.6 (raw x) and 6.6 (RMSNorm), 5 rows 9.7
and 12.3, 8 rows 14.0 and 18.1. Timed on an H100 (``bench/experiments/gemv_sweep.py --tokens 2 5 8``,
Llama-3-8B's layer chain of qkv, o, gate_up and down): 2 rows 157.7 us against cuBLAS's 171.9 (92% of
the copy rate), 5 rows 222.6 against 173.2, 8 rows 305.0 against 174.1; so
``KernelConfig.gemv_few_rows_max`` is 2 by default, and the verify step's 5 rows stay on cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import DEFAULTS, KernelConfig
from .elementwise import triton_silu_mul
from .gemv import NORM, RAW, gemv_config, gemv_epilogue, input_tile, launch_gemv, row_rstd, tile_input
from .triton_support import await_previous_kernel, pdl_launch, pow2, sm_count


@triton.jit
def _weight_tile(w_ptr, cols, N, w_st, k, K, VEC: tl.constexpr):
    # [BLOCK_N, BLOCK_K], zeros past N or K; contiguous in runs of a vector only, so that the load
    # gives each thread the VEC weights that multiply its VEC values of x.
    mask = (cols < N)[:, None] & (k < K)[None, :]
    return tl.load(tl.max_contiguous(w_ptr + cols.to(tl.int64)[:, None] * w_st + k[None, :], [1, VEC]), mask=mask,
                   other=0.0)


@triton.jit
def _row_sums(acc, x_ptr, x_st, t, T, nw_ptr, k, K, rstd, w, PROLOGUE: tl.constexpr, dtype: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr):
    # Row t of x (its prologue applied) times the weight tile, each thread's runs of VEC products summed
    # and added to the row's accumulator [BLOCK_N, BLOCK_K / VEC]; rows past T load nothing.
    row = tl.full([1], t, tl.int32)
    row_mask = row < T
    xk, partner = input_tile(x_ptr + row.to(tl.int64)[:, None] * x_st, nw_ptr, row_mask, k, K, PROLOGUE)
    xin = tile_input(xk, partner, rstd, PROLOGUE, dtype).to(tl.float32)
    return acc + tl.sum(tl.reshape(xin * w, [BLOCK_N, BLOCK_K // VEC, VEC]), axis=2)


@triton.jit
def _row_out(acc, t, T, b_ptr, r_ptr, y_ptr, cols, N, r_st, y_st, dtype: tl.constexpr, HAS_BIAS: tl.constexpr,
             HAS_RESIDUAL: tl.constexpr):
    row = tl.full([1], t, tl.int32)
    gemv_epilogue(tl.sum(acc, axis=1)[None, :], b_ptr, r_ptr, y_ptr, row, cols, row < T, cols < N, r_st, y_st,
                  dtype, HAS_BIAS, HAS_RESIDUAL)


@triton.jit
def _row_rstd(x_ptr, x_st, t, T, K, eps, NORM_BLOCK_K: tl.constexpr):
    row = tl.full([1], t, tl.int32)
    return row_rstd(x_ptr + row.to(tl.int64)[:, None] * x_st, row < T, K, eps, 1, NORM_BLOCK_K)


@triton.jit
def _few_rows_kernel(x_ptr, nw_ptr, w_ptr, b_ptr, r_ptr, y_ptr, T, N, K, eps, x_st, w_st, r_st, y_st,
                     PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
                     NORM_BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    # Program p computes output columns p*BLOCK_N .. +BLOCK_N of every row, stepping through K. Each
    # of the up to 8 rows has its own accumulator, written out by hand: a [BLOCK_T, BLOCK_N, ...]
    # accumulator's broadcast product makes Triton 3.6 lay the rows across threads (shuffles and
    # spills each step), and loop-carried tuples do not run under its interpreter.
    dtype = y_ptr.dtype.element_ty
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # The first weight tile goes out before the wait: weights are never written during a step.
    w = _weight_tile(w_ptr, cols, N, w_st, offs_k, K, VEC)
    await_previous_kernel(PDL)
    r0 = tl.zeros([1], tl.float32)
    r1 = tl.zeros([1], tl.float32)
    r2 = tl.zeros([1], tl.float32)
    r3 = tl.zeros([1], tl.float32)
    r4 = tl.zeros([1], tl.float32)
    r5 = tl.zeros([1], tl.float32)
    r6 = tl.zeros([1], tl.float32)
    r7 = tl.zeros([1], tl.float32)
    if PROLOGUE == NORM:
        r0 = _row_rstd(x_ptr, x_st, 0, T, K, eps, NORM_BLOCK_K)
        r1 = _row_rstd(x_ptr, x_st, 1, T, K, eps, NORM_BLOCK_K)
        if BLOCK_T > 2:
            r2 = _row_rstd(x_ptr, x_st, 2, T, K, eps, NORM_BLOCK_K)
        if BLOCK_T > 3:
            r3 = _row_rstd(x_ptr, x_st, 3, T, K, eps, NORM_BLOCK_K)
        if BLOCK_T > 4:
            r4 = _row_rstd(x_ptr, x_st, 4, T, K, eps, NORM_BLOCK_K)
        if BLOCK_T > 5:
            r5 = _row_rstd(x_ptr, x_st, 5, T, K, eps, NORM_BLOCK_K)
        if BLOCK_T > 6:
            r6 = _row_rstd(x_ptr, x_st, 6, T, K, eps, NORM_BLOCK_K)
        if BLOCK_T > 7:
            r7 = _row_rstd(x_ptr, x_st, 7, T, K, eps, NORM_BLOCK_K)
    a0 = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    a1 = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    a2 = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    a3 = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    a4 = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    a5 = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    a6 = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    a7 = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w_next = _weight_tile(w_ptr, cols, N, w_st, k0 + BLOCK_K + offs_k, K, VEC)
        k = k0 + offs_k
        wf = w.to(tl.float32)
        a0 = _row_sums(a0, x_ptr, x_st, 0, T, nw_ptr, k, K, r0, wf, PROLOGUE, dtype, BLOCK_N, BLOCK_K, VEC)
        a1 = _row_sums(a1, x_ptr, x_st, 1, T, nw_ptr, k, K, r1, wf, PROLOGUE, dtype, BLOCK_N, BLOCK_K, VEC)
        if BLOCK_T > 2:
            a2 = _row_sums(a2, x_ptr, x_st, 2, T, nw_ptr, k, K, r2, wf, PROLOGUE, dtype, BLOCK_N, BLOCK_K,
                             VEC)
        if BLOCK_T > 3:
            a3 = _row_sums(a3, x_ptr, x_st, 3, T, nw_ptr, k, K, r3, wf, PROLOGUE, dtype, BLOCK_N, BLOCK_K,
                             VEC)
        if BLOCK_T > 4:
            a4 = _row_sums(a4, x_ptr, x_st, 4, T, nw_ptr, k, K, r4, wf, PROLOGUE, dtype, BLOCK_N, BLOCK_K,
                             VEC)
        if BLOCK_T > 5:
            a5 = _row_sums(a5, x_ptr, x_st, 5, T, nw_ptr, k, K, r5, wf, PROLOGUE, dtype, BLOCK_N, BLOCK_K,
                             VEC)
        if BLOCK_T > 6:
            a6 = _row_sums(a6, x_ptr, x_st, 6, T, nw_ptr, k, K, r6, wf, PROLOGUE, dtype, BLOCK_N, BLOCK_K,
                             VEC)
        if BLOCK_T > 7:
            a7 = _row_sums(a7, x_ptr, x_st, 7, T, nw_ptr, k, K, r7, wf, PROLOGUE, dtype, BLOCK_N, BLOCK_K,
                             VEC)
        w = w_next
    _row_out(a0, 0, T, b_ptr, r_ptr, y_ptr, cols, N, r_st, y_st, dtype, HAS_BIAS, HAS_RESIDUAL)
    _row_out(a1, 1, T, b_ptr, r_ptr, y_ptr, cols, N, r_st, y_st, dtype, HAS_BIAS, HAS_RESIDUAL)
    if BLOCK_T > 2:
        _row_out(a2, 2, T, b_ptr, r_ptr, y_ptr, cols, N, r_st, y_st, dtype, HAS_BIAS, HAS_RESIDUAL)
    if BLOCK_T > 3:
        _row_out(a3, 3, T, b_ptr, r_ptr, y_ptr, cols, N, r_st, y_st, dtype, HAS_BIAS, HAS_RESIDUAL)
    if BLOCK_T > 4:
        _row_out(a4, 4, T, b_ptr, r_ptr, y_ptr, cols, N, r_st, y_st, dtype, HAS_BIAS, HAS_RESIDUAL)
    if BLOCK_T > 5:
        _row_out(a5, 5, T, b_ptr, r_ptr, y_ptr, cols, N, r_st, y_st, dtype, HAS_BIAS, HAS_RESIDUAL)
    if BLOCK_T > 6:
        _row_out(a6, 6, T, b_ptr, r_ptr, y_ptr, cols, N, r_st, y_st, dtype, HAS_BIAS, HAS_RESIDUAL)
    if BLOCK_T > 7:
        _row_out(a7, 7, T, b_ptr, r_ptr, y_ptr, cols, N, r_st, y_st, dtype, HAS_BIAS, HAS_RESIDUAL)


def few_rows_tiles(n: int, k: int, sms: int, x_bytes: int, config: KernelConfig = DEFAULTS) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, VEC, num_warps) for x of ``x_bytes`` a value times an [n, k] weight: the one-row
    GEMV's column tiling (``gemv_config``), VEC values a thread (16 bytes), K steps of VEC values
    times the threads, and the rows cut down to keep the tile within ``gemv_product_elements``."""
    warps = config.gemv_num_warps
    vec = 16 // x_bytes
    block_k = min(vec * 32 * warps, max(vec, pow2(k, 16)))
    block_n = max(1, min(gemv_config(1, n, k, sms, config).block_n, config.gemv_product_elements // block_k))
    return block_n, block_k, vec, warps


def launch_gemv_for_rows(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, *,
                         norm_weight: torch.Tensor | None = None, gated: bool = False,
                         bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                         eps: float = 0.0, config: KernelConfig = DEFAULTS) -> None:
    """``gemv.launch_gemv``'s result for checked operands: by this kernel at 2 to
    ``config.gemv_few_rows_max`` rows, else by ``launch_gemv``. Under the SiLU·mul prologue the few-row
    kernel runs on ``silu(gate) * up`` made first by the elementwise kernel: recomputing the SiLU of
    every row in every program would cost more instructions than the weight's stream has to spare."""
    rows, (n, k) = x.shape[0], weight.shape
    if not 1 < rows <= config.gemv_few_rows_max:
        launch_gemv(x, weight, out, norm_weight=norm_weight, gated=gated, bias=bias, residual=residual, eps=eps,
                    config=config)
        return
    if n == 0:
        return
    if gated:
        activated = torch.empty(rows, k, dtype=x.dtype, device=x.device)
        triton_silu_mul(*x.chunk(2, dim=-1), out=activated, config=config)
        x = activated
    block_n, block_k, vec, warps = few_rows_tiles(n, k, sm_count(x), x.element_size(), config)
    res = residual if residual is not None else out
    _few_rows_kernel[(triton.cdiv(n, block_n),)](
        x, norm_weight if norm_weight is not None else x, weight, bias if bias is not None else x, res, out,
        rows, n, k, eps, x.stride(0), weight.stride(0), res.stride(0), out.stride(0),
        PROLOGUE=NORM if norm_weight is not None else RAW, HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None, BLOCK_T=rows, BLOCK_N=block_n, BLOCK_K=block_k, VEC=vec,
        NORM_BLOCK_K=min(pow2(k, 16), config.gemv_norm_pass_elements),
        num_warps=warps, num_stages=config.gemv_num_stages, **pdl_launch(x, config.pdl))
