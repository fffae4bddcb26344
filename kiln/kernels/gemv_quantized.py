"""The quantized GEMV: ``gemv.py``'s fused decode GEMV reading 8-bit or MXFP4 weights, for any rows.

Decode at small batch reads every weight once per step, so a quantized GEMM is fast only if it reads
the quantized bytes and nothing else: this kernel loads the stored values (int8, fp8 e4m3, or MXFP4
bytes holding two e2m1 codes each), decodes them in registers and multiplies in f32. It keeps the
bf16 GEMV's fusions (the RMSNorm or SiLU·mul prologue, the bias or residual epilogue: the same
``gemv.py`` helpers) and computes what ``linear_quantized``'s references compute:

- per-channel schemes (``int8_channel``, ``fp8_channel``): ``acc = x @ q.T`` over the raw values,
  times the channel's f32 scale in the epilogue;
- ``mxfp4``: each tile's values times their block's power of two (``2^(e8m0 - 127)``) before the
  product, since a row's scale changes every 32 values;
- ``act_quant`` (W8A8): each row of the GEMM's input (after the prologue, rounded to the activation
  dtype as the unfused graph rounds it) is scaled by its largest magnitude and rounded to int8 or fp8,
  as ``quantize.quantize_rows`` does; a first pass over x finds that magnitude (x is a few KB, read
  from L2, as the norm's pass is), and the row's scale multiplies the accumulator in the epilogue.

The e2m1 decode is a bit move: an e2m1 code ``s e1 e0 m`` placed at fp16's sign and top bits
(``(c & 8) << 12 | (c & 7) << 9``) reads as the code's value times 2^-14, normal and subnormal alike
(fp16's exponent bias is 15, e2m1's is 1), so 2^14 goes into the block's scale.

Rows are cut into blocks of ``BLOCK_T`` (the first grid axis): 1 row multiplies by broadcasting, more
pad to 16 or ``quantized_gemv_block_t`` for ``tl.dot``, whose operands are the decoded values in the
activation dtype (int8, e4m3 and scaled e2m1 values are exact in bf16).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import triton
import triton.language as tl

from kiln.ir.weights import QuantScheme

from .config import DEFAULTS, KernelConfig
from .gemv import (GEMV_MAX_ROWS, NORM, RAW, SILU_MUL, gemv_config, gemv_epilogue, input_tile, row_rstd, tile_input,
                   tile_product)
from .triton_support import await_previous_kernel, dot_in_f32, pdl_launch, pow2, sm_count

# Weight kinds and activation quantizations the kernel knows (constexprs).
PER_CHANNEL = tl.constexpr(0)
MXFP4 = tl.constexpr(1)
ACT_NONE = tl.constexpr(0)
ACT_INT8 = tl.constexpr(1)
ACT_FP8 = tl.constexpr(2)
ACT_KINDS = {None: ACT_NONE, "int8_per_token": ACT_INT8, "fp8_per_token": ACT_FP8}
MX_BLOCK = 32


@triton.jit
def _round_half_even(v):
    # torch.round's rounding (ties to even), from floor: Triton has no portable rint. The fraction
    # v - floor(v) is exact (|v| is far below 2^23), unlike v + 0.5, which rounds just below a half up.
    r = tl.floor(v)
    fraction = v - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where((fraction > 0.5) | ((fraction == 0.5) & odd), r + 1.0, r)


@triton.jit
def _round_to_e4m3(v):
    # Round to nearest even on the e4m3 grid, in f32 arithmetic: 3 mantissa bits, so a normal value's
    # step is 2^(exponent - 3), the subnormals' 2^-9. Written out rather than cast because Triton
    # 3.6's interpreter rounds fp8 casts wrongly (ties away, no carry into the next binade); on the
    # GPU it is a few integer operations on the small input.
    exponent = ((v.to(tl.int32, bitcast=True) >> 23) & 255) - 127
    step = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    return _round_half_even(tl.math.div_rn(v, step)) * step


@triton.jit
def quantize_act(v, ACT: tl.constexpr):
    """``v`` (f32, already divided by its row's scale) rounded to ACT's 8-bit grid, as f32."""
    if ACT == ACT_INT8:
        return _round_half_even(tl.minimum(tl.maximum(v, -127.0), 127.0))
    return _round_to_e4m3(tl.minimum(tl.maximum(v, -448.0), 448.0))


@triton.jit
def act_scale(amax, ACT: tl.constexpr):
    # As the reference: the largest magnitude maps to the type's limit; an all-zero row gets scale 1.
    # Divisions round to nearest (div_rn) as torch's do: Triton's default f32 division is approximate,
    # and a scale or quotient an ulp off would move values sitting near a rounding boundary a whole
    # 8-bit step away from the reference's.
    if ACT == ACT_INT8:
        return tl.where(amax > 0, tl.math.div_rn(amax, 127.0), 1.0)
    return tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)


@triton.jit
def row_amax(x_rows, nw_ptr, row_mask, K, rstd, PROLOGUE: tl.constexpr, dtype: tl.constexpr,
             BLOCK_T: tl.constexpr, PASS_K: tl.constexpr):
    """The largest magnitude of each row of the GEMM's input (the prologue applied, rounded as in the
    unfused graph)."""
    offs = tl.arange(0, PASS_K)
    amax = tl.zeros([BLOCK_T], tl.float32)
    for k0 in range(0, K, PASS_K):
        xk, partner = input_tile(x_rows, nw_ptr, row_mask, k0 + offs, K, PROLOGUE)
        v = tile_input(xk, partner, rstd, PROLOGUE, dtype).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
    return amax


@triton.jit
def load_weight(w_ptr, s_ptr, cols, N, w_st, s_st, k0, K, WEIGHT: tl.constexpr, BLOCK_K: tl.constexpr):
    """The stored tile for weight columns ``cols`` (rows of W) and K offsets k0..k0+BLOCK_K, and for
    MXFP4 its block scales (per-channel scales are the epilogue's). Past N or K it loads zeros."""
    col_mask = (cols < N)[:, None]
    rows = cols.to(tl.int64)[:, None] * w_st
    if WEIGHT == MXFP4:
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        w = tl.load(w_ptr + rows + kb[None, :], mask=col_mask & (kb < K // 2)[None, :], other=0)
        ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        s = tl.load(s_ptr + cols.to(tl.int64)[:, None] * s_st + ks[None, :],
                    mask=col_mask & (ks < K // 32)[None, :], other=127)
    else:  # an else, not a fall-through: compiled Triton types both returns of a function otherwise
        k = k0 + tl.arange(0, BLOCK_K)
        # other=0.0: an integer fill cannot be cast to fp8.
        w = tl.load(w_ptr + rows + k[None, :], mask=col_mask & (k < K)[None, :], other=0.0)
        s = w
    return w, s


@triton.jit
def decode_weight(w, s, WEIGHT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The loaded tile as f32 values [BLOCK_N, BLOCK_K]: per-channel values as stored (their scale
    comes in the epilogue), MXFP4 codes decoded and scaled by their block's power of two."""
    if WEIGHT == MXFP4:
        codes = w.to(tl.int32)
        pairs = tl.reshape(tl.join(codes & 15, codes >> 4), [BLOCK_N, BLOCK_K])  # low nibble first
        half = (((pairs & 8) << 12) | ((pairs & 7) << 9)).to(tl.uint16).to(tl.float16, bitcast=True)
        # 2^(e - 127) times the 2^14 the fp16 reading leaves out; e8m0 exponents past 240 (block
        # magnitudes over 2^115) would overflow f32 here and occur in no weight.
        factor = tl.exp2(s.to(tl.float32) - 113.0)
        blocks = tl.reshape(half.to(tl.float32), [BLOCK_N, BLOCK_K // 32, 32]) * factor[:, :, None]
        values = tl.reshape(blocks, [BLOCK_N, BLOCK_K])
    else:  # not a fall-through: compiled Triton types both returns otherwise (the packed tile is half as wide)
        values = w.to(tl.float32)
    return values


@triton.jit
def _qgemv_kernel(x_ptr, nw_ptr, w_ptr, s_ptr, b_ptr, r_ptr, y_ptr, T, N, K, eps, x_st, w_st, s_st, r_st, y_st,
                  WEIGHT: tl.constexpr, ACT: tl.constexpr, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr,
                  HAS_RESIDUAL: tl.constexpr, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr,
                  DOT_IN_DTYPE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  PASS_K: tl.constexpr, PDL: tl.constexpr):
    # Program (q, p) computes rows q*BLOCK_T.. of output columns p*BLOCK_N..: the row blocks of one
    # column tile are neighbours in launch order, so all but the first read its weights from L2. The
    # next weight tile's loads go out before this one's arithmetic, as in gemv.py.
    dtype = y_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < T
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_st
    w, s = load_weight(w_ptr, s_ptr, cols, N, w_st, s_st, 0, K, WEIGHT, BLOCK_K)
    await_previous_kernel(PDL)
    rstd = tl.zeros([BLOCK_T], tl.float32)
    if PROLOGUE == NORM:
        rstd = row_rstd(x_rows, row_mask, K, eps, BLOCK_T, PASS_K)
    x_scale = tl.full([BLOCK_T], 1.0, tl.float32)
    if ACT != ACT_NONE:
        x_scale = act_scale(row_amax(x_rows, nw_ptr, row_mask, K, rstd, PROLOGUE, dtype, BLOCK_T, PASS_K), ACT)
    xk, partner = input_tile(x_rows, nw_ptr, row_mask, offs_k, K, PROLOGUE)
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w_next, s_next = load_weight(w_ptr, s_ptr, cols, N, w_st, s_st, k0 + BLOCK_K, K, WEIGHT, BLOCK_K)
        x_next, partner_next = input_tile(x_rows, nw_ptr, row_mask, k0 + BLOCK_K + offs_k, K, PROLOGUE)
        xin = tile_input(xk, partner, rstd, PROLOGUE, dtype)
        if ACT != ACT_NONE:
            xin = quantize_act(tl.math.div_rn(xin.to(tl.float32), x_scale[:, None]), ACT)
        wv = decode_weight(w, s, WEIGHT, BLOCK_N, BLOCK_K)
        if DOT_IN_DTYPE:  # tl.dot on 16-bit operands: both in the activation dtype
            xin = xin.to(dtype)
            wv = wv.to(dtype)
        acc += tile_product(xin, wv, USE_DOT, DOT_F32)
        w = w_next
        s = s_next
        xk = x_next
        partner = partner_next
    if WEIGHT == PER_CHANNEL:
        acc *= tl.load(s_ptr + cols, mask=col_mask, other=0.0)[None, :]
    if ACT != ACT_NONE:
        acc *= x_scale[:, None]
    gemv_epilogue(acc, b_ptr, r_ptr, y_ptr, rows, cols, row_mask, col_mask, r_st, y_st, dtype, HAS_BIAS, HAS_RESIDUAL)


@functools.lru_cache(maxsize=None)
def _one_row_config(config: KernelConfig) -> KernelConfig:
    # The bf16 GEMV's tiling with the quantized tile sizes (replace() validates every field: once).
    return replace(config, gemv_product_elements=config.quantized_gemv_product_elements,
                   gemv_block_n=config.quantized_gemv_block_n, gemv_dot_block_k=config.quantized_gemv_dot_block_k)


def launch_quantized_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out: torch.Tensor, *,
                          scheme: QuantScheme, act_quant: str | None, norm_weight: torch.Tensor | None = None,
                          gated: bool = False, bias: torch.Tensor | None = None,
                          residual: torch.Tensor | None = None, eps: float = 0.0,
                          config: KernelConfig = DEFAULTS) -> None:
    """``out = epilogue(act(prologue(x)) @ dequantize(weight).T)`` for checked operands
    (``linear_quantized_triton`` checks them): ``weight`` [N, K / pack] in ``scheme``'s storage,
    ``weight_scale`` its one scale tensor, the prologue and epilogue as ``gemv.launch_gemv``'s."""
    rows, n, k = x.shape[0], weight.shape[0], weight.shape[1] * scheme.pack
    if rows == 0 or n == 0:
        return
    mx = scheme.block is not None
    cfg = gemv_config(min(rows, GEMV_MAX_ROWS), n, k, sm_count(x), _one_row_config(config))
    block_t = cfg.block_t if rows <= GEMV_MAX_ROWS else max(16, min(pow2(rows), config.quantized_gemv_block_t))
    # An MX tile holds whole blocks of 32; a tl.dot needs 16 of K at least (block_k is a power of two).
    block_k = max(cfg.block_k, MX_BLOCK if mx else 16)
    prologue = NORM if norm_weight is not None else SILU_MUL if gated else RAW
    dot_f32 = dot_in_f32(x.dtype)
    res = residual if residual is not None else out
    grid = (triton.cdiv(rows, block_t), triton.cdiv(n, cfg.block_n))
    _qgemv_kernel[grid](
        x, norm_weight if norm_weight is not None else x, weight, weight_scale, bias if bias is not None else x,
        res, out, rows, n, k, eps, x.stride(0), weight.stride(0), weight_scale.stride(0), res.stride(0),
        out.stride(0), WEIGHT=MXFP4 if mx else PER_CHANNEL, ACT=ACT_KINDS[act_quant], PROLOGUE=prologue,
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, USE_DOT=block_t > 1,
        DOT_F32=dot_f32, DOT_IN_DTYPE=block_t > 1 and not dot_f32, BLOCK_T=block_t, BLOCK_N=cfg.block_n,
        BLOCK_K=block_k,
        PASS_K=min(pow2(k, 16), max(16, config.gemv_norm_pass_elements // block_t)),
        num_warps=config.gemv_num_warps, num_stages=config.gemv_num_stages, **pdl_launch(x, config.pdl))
