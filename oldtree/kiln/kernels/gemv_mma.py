"""The GEMV on Hopper's tensor cores: the weight tile is the matrix product's left operand.

At a few rows a GEMM's time is its weight bytes over the memory's rate, if the kernel does little per
weight. ``gemv_quantized_row``'s broadcast product decodes every 8-bit weight with integer bit moves
and multiplies in f32, ~8 instructions a weight, which on sm_90 held Llama-3-8B's fp8 layer at 127 us
(an H100; bf16's GEMV 160 us for twice the bytes). Hopper's warpgroup MMA (wgmma) takes e4m3, int8 and
16-bit operands as they are stored, with no thread touching a weight value, but its left operand is 64
rows tall and x has 1-64 rows. So the product is computed transposed, ``y.T = W @ x.T``: 64 weight
rows are the MMA's rows and x's rows, padded to 16, its columns (``m64n16k32``; ``x @ W.T`` would pad x
to 64 rows and, at fewer, go through mma.sync with every e4m3 weight converted to f16). Triton lowers
the ``tl.dot`` to wgmma and streams the weight tiles through shared memory ahead of it
(``num_stages``). The fp8 layer: 97-99 us at one row, 116 us at 64 (``_scaled_mm`` with the
activation quantizer 143 us); ``bench/experiments/mma_gemv_probe.py``.

- W8A8 (``linear_quantized_triton``, up to ``KernelConfig.mma_gemv_max_rows``): x comes quantized per
  token (``act_quant_triton.quantize_rows``: 8-bit values and f32 scales, the RMSNorm or SiLU·mul
  prologue applied there), or, with ``mma_gemv_quantizes``, every program quantizes its rows itself
  with the same helpers (a launch fewer a GEMM, x re-read from L2 by each program); the epilogue
  multiplies each sum by its channel's and its row's scale (int8's exact int32 sums first converted).
  fp8 products are moved into an f32 accumulator every ``FP8_PROMOTE_EVERY`` values of K: Hopper's fp8
  MMA keeps fewer bits than f32 in its own accumulator (Triton's sm_90 default never promotes), which
  at Llama's K of 4096-14336 costs percent-level errors.

The bias or residual is added by ``gemv.gemv_epilogue``, so the results are ``gemv_quantized``'s and
``gemv``'s. No split-K: every output is one program's sum in one order, deterministic as the other
GEMVs; splitting Llama-3-8B's 4096-column GEMMs (64 tiles on 132 SMs) measured no faster. Weight-only
schemes stay with the other GEMVs: MXFP4 decoded in registers for a bf16 wgmma measured 3.3x slower
than ``gemv_quantized_row`` at one row. So do 16-bit weights: bf16 through this kernel (the prologue
applied to x's tiles) took 250 us for Llama-3-8B's layer at 5 and 9 rows against cuBLAS's 175 (H100),
and a speculative verify step 1.56x a plain step against cuBLAS's 1.19x.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .act_quant_triton import ACT_INT8, ACT_KINDS, HARDWARE_FP8, act_scale, quantize_act, quantize_rows, \
    row_amax
from .config import DEFAULTS, KernelConfig
from .gemv import NORM, RAW, SILU_MUL, gemv_epilogue, input_tile, row_rstd, tile_input
from .triton_support import INTERPRET, await_previous_kernel, device_capability, pdl_launch, pow2

# wgmma's left operand is 64 rows (a warpgroup's tile); its right operand 8-256 columns, 16 here at
# least (tl.dot's smallest).
MMA_ROWS = 64
MIN_BLOCK_T = 16
# K values whose fp8 products the MMA sums in its own accumulator before they are added in f32 (the
# DeepSeek-V3 report promotes every 128).
FP8_PROMOTE_EVERY = 128


@triton.jit
def _mma_gemv_kernel(x_ptr, xs_ptr, nw_ptr, w_ptr, s_ptr, b_ptr, r_ptr, y_ptr, T, N, K, eps, x_st, w_st, r_st, y_st,
                     ACT: tl.constexpr, QUANTIZE: tl.constexpr, PROLOGUE: tl.constexpr, HARDWARE: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, DOT_F32: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, PASS_K: tl.constexpr,
                     PROMOTE_EVERY: tl.constexpr, PDL: tl.constexpr):
    # Program (p, q) computes output columns p*BLOCK_N.. of rows q*BLOCK_T.. as acc[column, row]. With
    # QUANTIZE, x is the GEMM's 16-bit input before its PROLOGUE and each program quantizes its rows
    # itself (their rstd and largest magnitude from passes over x, read from L2), else x holds the
    # quantized rows and xs_ptr their scales.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    col_mask = cols < N
    row_mask = rows < T
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * w_st
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_st
    await_previous_kernel(PDL)  # x is the previous kernel's output
    dtype = x_ptr.dtype.element_ty
    rstd = tl.zeros([BLOCK_T], tl.float32)
    if PROLOGUE == NORM:
        rstd = row_rstd(x_rows, row_mask, K, eps, BLOCK_T, PASS_K)
    if QUANTIZE:
        x_scale = act_scale(row_amax(x_rows, nw_ptr, row_mask, K, rstd, PROLOGUE, dtype, PASS_K, BLOCK_T), ACT)
    else:
        x_scale = tl.load(xs_ptr + rows, mask=row_mask, other=1.0)
    if ACT == ACT_INT8:
        acc = tl.zeros([BLOCK_N, BLOCK_T], tl.int32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        # other=0.0: an integer fill cannot be cast to fp8.
        w = tl.load(w_rows + k[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        if QUANTIZE:
            xk, partner = input_tile(x_rows, nw_ptr, row_mask, k, K, PROLOGUE)
            x = tile_input(xk, partner, rstd, PROLOGUE, dtype)
            x = quantize_act(tl.math.div_rn(x.to(tl.float32), x_scale[:, None]), ACT, HARDWARE)
        else:
            x = tl.load(x_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if DOT_F32:  # the interpreter multiplies bf16 and 8-bit bit patterns: f32 copies instead
            acc += tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee").to(acc.dtype)
        elif ACT == ACT_INT8:
            acc += tl.dot(w, tl.trans(x), out_dtype=tl.int32)
        else:
            acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=PROMOTE_EVERY)
    scaled = acc.to(tl.float32) * tl.load(s_ptr + cols, mask=col_mask, other=0.0)[:, None] * x_scale[None, :]
    gemv_epilogue(tl.trans(scaled), b_ptr, r_ptr, y_ptr, rows, cols, row_mask, col_mask, r_st, y_st,
                  y_ptr.dtype.element_ty, HAS_BIAS, HAS_RESIDUAL)


def mma_gemv_tiles(rows: int, k: int, config: KernelConfig = DEFAULTS,
                   input_bytes: int | None = None) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_T, BLOCK_K) of the MMA GEMV for ``rows`` rows over ``k``: K steps of
    ``mma_gemv_block_k``, halved until the pipelined tiles fit ``mma_gemv_smem_bytes`` (at 64 rows:
    512 would take 256 KB of an H100's 227). Shared memory holds the 8-bit weight tiles and x's: its
    8-bit rows quantized before the launch, or (``input_bytes``: the size of x's values, which each
    program quantizes itself) x's tiles and their quantized copy, the MMA's operand."""
    x_bytes = 1 if input_bytes is None else input_bytes + 1
    block_t = max(MIN_BLOCK_T, pow2(rows))
    block_k = min(config.mma_gemv_block_k, pow2(k, 32))
    while block_k > 32 and (MMA_ROWS + block_t * x_bytes) * block_k * config.mma_gemv_num_stages \
            > config.mma_gemv_smem_bytes:
        block_k //= 2
    return MMA_ROWS, block_t, block_k


def runs_mma_gemv(x: torch.Tensor, act_quant: str | None, config: KernelConfig = DEFAULTS) -> bool:
    """Whether ``launch_mma_gemv`` takes these rows: W8A8 (``act_quant`` set) up to
    ``mma_gemv_max_rows``, on compute capability 9.x (wgmma) or under the interpreter."""
    fits = act_quant is not None and x.shape[0] <= config.mma_gemv_max_rows
    return fits and (INTERPRET or (x.device.type == "cuda" and device_capability(x)[0] == 9))


def launch_mma_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out: torch.Tensor, *,
                    act_quant: str, norm_weight: torch.Tensor | None = None, gated: bool = False,
                    bias: torch.Tensor | None = None, residual: torch.Tensor | None = None, eps: float = 0.0,
                    config: KernelConfig = DEFAULTS) -> None:
    """``out = epilogue(prologue(x) @ W.T)`` for checked operands: ``weight`` [N, K] 8-bit per channel
    with its scales and activations quantized per token (``act_quant``; ``gemv_quantized``'s result):
    two launches, the quantized rows (prologue applied), then the GEMV on them, or, with
    ``mma_gemv_quantizes``, one that quantizes x in every program."""
    rows, (n, k) = x.shape[0], weight.shape
    if rows == 0 or n == 0:
        return
    prologue = NORM if norm_weight is not None else SILU_MUL if gated else RAW
    x_scale = x
    quantizes = config.mma_gemv_quantizes
    if not quantizes:
        x, x_scale = quantize_rows(x, act_quant, norm_weight=norm_weight, gated=gated, eps=eps, config=config)
        prologue = RAW
    block_n, block_t, block_k = mma_gemv_tiles(rows, k, config, x.element_size() if quantizes else None)
    res = residual if residual is not None else out
    _mma_gemv_kernel[(triton.cdiv(n, block_n), triton.cdiv(rows, block_t))](
        x, x_scale, norm_weight if norm_weight is not None else x, weight, weight_scale,
        bias if bias is not None else out, res, out, rows, n, k, eps,
        x.stride(0), weight.stride(0), res.stride(0), out.stride(0), ACT=ACT_KINDS[act_quant], QUANTIZE=quantizes,
        PROLOGUE=prologue, HARDWARE=HARDWARE_FP8, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        DOT_F32=INTERPRET, BLOCK_N=block_n, BLOCK_T=block_t, BLOCK_K=block_k,
        PASS_K=min(pow2(k, 16), max(16, config.gemv_norm_pass_elements // block_t)),
        PROMOTE_EVERY=min(FP8_PROMOTE_EVERY, block_k), num_warps=4, num_stages=config.mma_gemv_num_stages,
        **pdl_launch(x, config.pdl))
