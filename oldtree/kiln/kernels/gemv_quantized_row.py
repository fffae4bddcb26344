"""The one-row quantized GEMV (batch-1 decode): ``gemv.py``'s one-row GEMV reading fp8, int8 or MXFP4
weights, one launch per linear whatever the scheme.

One row of x times an [N, K] weight is a read of the weight with two flops a value, so the kernel is
fast only if it streams the stored bytes at the memory's rate and spends few instructions a byte:
an H100 at ~3 TB/s must take in ~13 fp8 values or ~26 MXFP4 values a clock per SM, against 128
lane-instructions a clock (64 of them integer). So, per program (``BLOCK_N`` weight rows, stepping
through K in ``BLOCK_K`` tiles with the next tile's loads in flight, as ``gemv.py``):

- x's tile takes the weight tile's layout, not the reverse: each thread loads VEC values of x (16
  bytes) and, in every row of the tile, the VEC / pack weight bytes they multiply, with every thread
  along K (``row_tiles``), so the loop moves nothing between threads (no shared memory, barriers or
  shuffles) and x's prologue and rounding cost once per BLOCK_N weights;
- the weight bytes are decoded by bit moves (``quant_decode``): a few integer operations a value,
  no conversions;
- x multiplies by broadcasting in f32 (no tl.dot: a tensor-core MMA on one row wastes 15/16 of it and
  sends the weights through shared memory) into an accumulator of the tile's shape (per-channel) or of
  its thread vectors (MXFP4), reduced across threads once, after the loop, not every step;
- MXFP4: a thread's VEC / 2 bytes lie in one 32-value block, so their partial sum takes the block's
  scale once (one scale byte and one multiply a vector); x's VEC values split into its even elements
  (the low nibbles' partners) and odd ones in registers;
- the power of two the bit decodes leave out goes into x (a tile of x serves BLOCK_N weight rows)
  and the epilogue, never into each value;
- W8A8 (``act_quant``): each program finds the row's scale itself (a pass over x, read from L2, as
  the RMSNorm prologue's pass) and rounds x's tile to the 8-bit grid in registers, so a W8A8 linear
  is one launch, as a bf16 one, instead of a quantizer launch before the GEMV.

Numerics are the references' (``linear_quantized``): the products of the stored values and of x (or
of its 8-bit rounding) are exact in f32, scaled by powers of two and by the f32 scales; only the order
of the f32 sums differs. The prologue (RMSNorm, SiLU·mul) and epilogue (bias, residual) are
``gemv.py``'s helpers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ir.weights import QuantScheme

from .act_quant_triton import ACT_KINDS, ACT_NONE, HARDWARE_FP8, act_scale, quantize_act, row_amax
from .config import DEFAULTS, KernelConfig
from .gemv import NORM, RAW, SILU_MUL, gemv_config, gemv_epilogue, input_tile, row_rstd, tile_input
from .gemv_quantized import gemv_tiling
from .quant_decode import E2M1_BITS_SHIFT, E4M3_BITS_SHIFT, MX_BLOCK, MXFP4, PER_CHANNEL, e2m1_bits, e4m3_bits, \
    int8_value
from .triton_support import await_previous_kernel, pdl_launch, pow2, sm_count

# The powers of two ``e4m3_bits`` (2^-120) and ``e2m1_bits`` (2^-126) leave out, split between x and
# the result so that neither overflows: x times 2^60 (2^63) holds any |x| below 2^68 (2^65), and the
# products stay normal f32 for |x| above 2^-60.
FP8_X_SHIFT = 60
MX_X_SHIFT = 63
# An MX block's scale bits plus this, shifted into f32's exponent, are its scale times the 2^(126 - 63) left out.
MX_SCALE_BIAS = tl.constexpr(E2M1_BITS_SHIFT - MX_X_SHIFT)
# The kernel's view of an MX block (a jit function reads only constexpr globals).
MX_VALUES = tl.constexpr(MX_BLOCK)


@triton.jit
def _load_tile(w_ptr, s_ptr, cols, N, w_st, s_st, k0, K, WEIGHT: tl.constexpr, BLOCK_K: tl.constexpr,
               VEC: tl.constexpr):
    # The stored bytes for K offsets k0..k0+BLOCK_K of weight rows ``cols`` ([BLOCK_N, BLOCK_K / pack]),
    # zeros past N or K; for MXFP4 also the scale of each thread's vector [BLOCK_N, BLOCK_K / VEC]
    # (VEC / 2 bytes of one block: the threads of a block read the same byte, one sector).
    # The pointers are declared contiguous in runs of a vector only, so that the load's layout gives each
    # thread the VEC / pack bytes that multiply its VEC values of x (16 bytes of x) and nothing moves
    # between threads in the loop.
    col_mask = (cols < N)[:, None]
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * w_st
    if WEIGHT == MXFP4:
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        w = tl.load(tl.max_contiguous(w_rows + kb[None, :], [1, VEC // 2]), mask=col_mask & (kb < K // 2)[None, :], other=0)
        # Loaded as [vectors, rows] and transposed: the scale bytes are not contiguous either way, and
        # so laid out the load gives each thread its vectors' scales, where [rows, vectors] would
        # spread the rows over threads and move the scales between threads in the loop.
        blocks = (k0 + VEC * tl.arange(0, BLOCK_K // VEC)) // MX_VALUES
        s = tl.trans(tl.load(s_ptr + cols.to(tl.int64)[None, :] * s_st + blocks[:, None],
                             mask=col_mask.T & (blocks < K // MX_VALUES)[:, None], other=127))
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(tl.max_contiguous(w_rows + k[None, :], [1, VEC]), mask=col_mask & (k < K)[None, :], other=0.0)
        s = w
    return w, s


@triton.jit
def _run_sums(products, BLOCK_N: tl.constexpr, RUNS: tl.constexpr, RUN: tl.constexpr):
    # Sums of each thread's contiguous RUN values of a [BLOCK_N, RUNS * RUN] tile: [BLOCK_N, RUNS],
    # summed in order within the thread (a multiply and RUN - 1 fused multiply-adds).
    return tl.sum(tl.reshape(products, [BLOCK_N, RUNS, RUN]), axis=2)


@triton.jit
def _qgemv_row_kernel(x_ptr, nw_ptr, w_ptr, s_ptr, b_ptr, r_ptr, y_ptr, N, K, eps, w_st, s_st,
                      WEIGHT: tl.constexpr, FP8: tl.constexpr, ACT: tl.constexpr, PROLOGUE: tl.constexpr,
                      HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HARDWARE: tl.constexpr,
                      X_FACTOR: tl.constexpr, OUT_FACTOR: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, VEC: tl.constexpr, PASS_K: tl.constexpr, PDL: tl.constexpr):
    # x's tile [1, BLOCK_K] takes VEC values (16 bytes) a thread, every thread along K (BLOCK_K is at
    # least VEC times the threads), and the weight tile [BLOCK_N, BLOCK_K] the same columns: a
    # thread's x values multiply its own weight bytes in every row, so the loop moves nothing between
    # threads, and x's prologue and rounding are paid once per BLOCK_N weights.
    dtype = y_ptr.dtype.element_ty
    rows = tl.arange(0, 1)
    row_mask = rows < 1
    x_rows = x_ptr + rows.to(tl.int64)[:, None]
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    offs_k = tl.arange(0, BLOCK_K)
    # The first weight tile goes out before the wait (weights are never written during a step).
    w, s = _load_tile(w_ptr, s_ptr, cols, N, w_st, s_st, 0, K, WEIGHT, BLOCK_K, VEC)
    await_previous_kernel(PDL)
    rstd = tl.zeros([1], tl.float32)
    if PROLOGUE == NORM:
        rstd = row_rstd(x_rows, row_mask, K, eps, 1, PASS_K)
    x_scale = tl.full([1], 1.0, tl.float32)
    if ACT != ACT_NONE:
        x_scale = act_scale(row_amax(x_rows, nw_ptr, row_mask, K, rstd, PROLOGUE, dtype, PASS_K), ACT)
    if WEIGHT == MXFP4:
        acc = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w_next, s_next = _load_tile(w_ptr, s_ptr, cols, N, w_st, s_st, k0 + BLOCK_K, K, WEIGHT, BLOCK_K, VEC)
        xk, partner = input_tile(x_rows, nw_ptr, row_mask, k0 + offs_k, K, PROLOGUE)
        xin = tile_input(xk, partner, rstd, PROLOGUE, dtype).to(tl.float32)
        if ACT != ACT_NONE:
            xin = quantize_act(tl.math.div_rn(xin, x_scale[:, None]), ACT, HARDWARE).to(tl.float32)
        xin = xin * X_FACTOR  # the power of two the bit decode leaves out (once per BLOCK_N weights)
        if WEIGHT == MXFP4:
            # A thread's VEC / 2 bytes are VEC values of one block: their sum takes the block's scale.
            low, high = e2m1_bits(w)
            x_even, x_odd = tl.split(tl.reshape(xin, [1, BLOCK_K // 2, 2]))
            sums = _run_sums(low * x_even, BLOCK_N, BLOCK_K // VEC, VEC // 2) + \
                _run_sums(high * x_odd, BLOCK_N, BLOCK_K // VEC, VEC // 2)
            acc += sums * ((s.to(tl.int32) + MX_SCALE_BIAS) << 23).to(tl.float32, bitcast=True)
        else:
            if FP8:
                values = e4m3_bits(w)
            else:
                values = int8_value(w)
            acc += values * xin
        w = w_next
        s = s_next
    out = tl.sum(acc, axis=1)[None, :]
    if WEIGHT == PER_CHANNEL:
        out *= tl.load(s_ptr + cols, mask=col_mask, other=0.0)[None, :] * OUT_FACTOR
    if ACT != ACT_NONE:
        out *= x_scale[:, None]
    gemv_epilogue(out, b_ptr, r_ptr, y_ptr, rows, cols, row_mask, col_mask, 0, 0, dtype, HAS_BIAS, HAS_RESIDUAL)


def row_tiles(n: int, k: int, sms: int, pack: int, x_bytes: int,
              config: KernelConfig = DEFAULTS) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, VEC, num_warps) of the one-row GEMV over an [n, k] weight stored ``pack``
    values a byte, for x of ``x_bytes`` bytes a value: the bf16 GEMV's column tiling under the quantized
    bounds (``gemv_quantized.gemv_tiling``), VEC values of x a thread (16 bytes: one load), and K
    steps of at least VEC values a thread so that every thread lies along K (``_qgemv_row_kernel``),
    the rows cut down to keep the tile within ``quantized_gemv_product_elements`` values."""
    warps = config.quantized_gemv_num_warps
    vec = 16 // x_bytes
    cfg = gemv_config(1, n, k, sms, gemv_tiling(config, pack))
    block_k = max(cfg.block_k, vec * 32 * warps)
    block_n = max(1, min(cfg.block_n, config.quantized_gemv_product_elements // block_k))
    return block_n, block_k, vec, warps


def row_constants(n: int, k: int, sms: int, *, pack: int, fp8: bool, act_quant: str | None, prologue: int,
                  x_bytes: int, config: KernelConfig = DEFAULTS) -> tuple[dict, int]:
    """The kernel's tiling and decode constexprs for an [n, k] weight stored ``pack`` values a byte
    (``fp8``: e4m3 values) and x of ``x_bytes`` a value, and its warps (the flags for the bias,
    residual and launch are the caller's)."""
    block_n, block_k, vec, warps = row_tiles(n, k, sms, pack, x_bytes, config)
    if pack == 2:
        x_factor, out_factor = 2.0 ** MX_X_SHIFT, 1.0
    elif fp8:
        x_factor, out_factor = 2.0 ** FP8_X_SHIFT, 2.0 ** (E4M3_BITS_SHIFT - FP8_X_SHIFT)
    else:
        x_factor, out_factor = 1.0, 1.0
    return dict(WEIGHT=MXFP4 if pack == 2 else PER_CHANNEL, FP8=fp8, ACT=ACT_KINDS[act_quant], PROLOGUE=prologue,
                X_FACTOR=x_factor, OUT_FACTOR=out_factor, BLOCK_N=block_n, BLOCK_K=block_k, VEC=vec,
                PASS_K=min(pow2(k, 16), config.gemv_norm_pass_elements)), warps


def launch_quantized_row_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out: torch.Tensor,
                              *, scheme: QuantScheme, act_quant: str | None, norm_weight: torch.Tensor | None = None,
                              gated: bool = False, bias: torch.Tensor | None = None,
                              residual: torch.Tensor | None = None, eps: float = 0.0,
                              config: KernelConfig = DEFAULTS) -> None:
    """``gemv_quantized.launch_quantized_gemv``'s result for one row of x, in one launch."""
    n, k = weight.shape[0], weight.shape[1] * scheme.pack
    if n == 0:
        return
    constants, warps = row_constants(n, k, sm_count(x), pack=scheme.pack, fp8=weight.dtype == torch.float8_e4m3fn,
                                     act_quant=act_quant,
                                     prologue=NORM if norm_weight is not None else SILU_MUL if gated else RAW,
                                     x_bytes=x.element_size(), config=config)
    _qgemv_row_kernel[(triton.cdiv(n, constants["BLOCK_N"]),)](
        x, norm_weight if norm_weight is not None else x, weight, weight_scale, bias if bias is not None else out,
        residual if residual is not None else out, out, n, k, eps, weight.stride(0), weight_scale.stride(0),
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, HARDWARE=HARDWARE_FP8,
        num_warps=warps, num_stages=config.gemv_num_stages, **constants, **pdl_launch(x, config.pdl))
