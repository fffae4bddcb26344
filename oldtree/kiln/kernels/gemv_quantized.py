"""The quantized GEMV: ``gemv.py``'s fused decode GEMV reading 8-bit or MXFP4 weights, for 2 or more rows.

Decode at small batch reads every weight once per step, so a quantized GEMM is fast only if it reads
the quantized bytes and little else: this kernel loads the stored values (int8, fp8 e4m3, or MXFP4
bytes holding two e2m1 codes each), decodes them in registers and multiplies in f32. It keeps the
bf16 GEMV's fusions (the RMSNorm or SiLU·mul prologue, the bias or residual epilogue: the same
``gemv.py`` helpers) and computes what ``linear_quantized``'s references compute:

- per-channel schemes (``int8_channel``, ``fp8_channel``): ``acc = x @ q.T`` over the raw values,
  times the channel's f32 scale in the epilogue;
- ``mxfp4``: each 32-value block's products times the block's power of two (``2^(e8m0 - 127)``);
- ``act_quant`` (W8A8): the GEMM's input is quantized per token once, before the GEMV, by
  ``act_quant_triton`` (which applies the prologue), and the GEMV reads the quantized rows (int8, or
  e4m3 values held in f16, which the tensor cores take without a conversion) and multiplies the
  accumulator by each row's scale in the epilogue. Quantizing inside the GEMV would redo the
  rows' magnitude pass and the rounding in every one of its N / BLOCK_N programs (at one row that
  pass is cheaper than a launch: ``gemv_quantized_row`` does it).

MXFP4 is decoded without moving values between threads: a byte's low nibble is an even-indexed value
and its high nibble the next one, so the low nibbles multiply x's even elements (loaded at stride 2)
and the high nibbles its odd ones instead of interleaving the decoded values (the weight tile is 8-16x
larger than x's). The e2m1 decode is bit moves and a multiply (``quant_decode.e2m1_pair``).

Rows: one row is ``gemv_quantized_row``'s kernel (a broadcast product, W8A8's activations quantized in
it). 2-16 rows pad to 16 for ``tl.dot``, whose operands are W8A8's 8-bit values as they are
(``_channel_dot``) or the decoded values in the activation dtype (int8 and scaled e2m1 values are
exact in bf16); more are cut into blocks of ``quantized_gemv_block_t`` (the first grid axis) with a
GEMM's tile of ``quantized_gemm_block_n`` columns, so that each row block of x read from L2 serves
many weight rows.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import triton
import triton.language as tl

from kiln.ir.weights import QuantScheme

from .act_quant_triton import ACT_FP8, ACT_INT8, ACT_KINDS, ACT_NONE, quantize_rows
from .config import DEFAULTS, KernelConfig
from .gemv import GEMV_MAX_ROWS, NORM, RAW, SILU_MUL, gemv_config, gemv_epilogue, input_tile, row_rstd, tile_input, \
    tile_product
from .quant_decode import MX_BLOCK, MXFP4, PER_CHANNEL, e2m1_pair, mx_factor
from .triton_support import await_previous_kernel, dot_in_f32, pdl_launch, pow2, sm_count

@triton.jit
def load_weight(w_ptr, s_ptr, cols, N, w_st, s_st, k0, K, WEIGHT: tl.constexpr, BLOCK_K: tl.constexpr):
    """The stored tile for weight columns ``cols`` (rows of W) and K offsets k0..k0+BLOCK_K, zeros past
    N or K: per-channel values [BLOCK_N, BLOCK_K] (their scales are the epilogue's), or MXFP4 bytes
    [BLOCK_N, BLOCK_K / 2] with each byte's block scale beside it (the same byte for 16 bytes in a
    row: cached loads)."""
    col_mask = (cols < N)[:, None]
    rows = cols.to(tl.int64)[:, None] * w_st
    if WEIGHT == MXFP4:
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        mask = col_mask & (kb < K // 2)[None, :]
        w = tl.load(w_ptr + rows + kb[None, :], mask=mask, other=0)
        s = tl.load(s_ptr + cols.to(tl.int64)[:, None] * s_st + (kb // 16)[None, :], mask=mask, other=127)
    else:  # an else, not a fall-through: compiled Triton types both returns of a function otherwise
        k = k0 + tl.arange(0, BLOCK_K)
        # other=0.0: an integer fill cannot be cast to fp8.
        w = tl.load(w_ptr + rows + k[None, :], mask=col_mask & (k < K)[None, :], other=0.0)
        s = w
    return w, s


@triton.jit
def decode_pairs(w, s):
    """MXFP4 bytes and their scales (``load_weight``) as f32 values: the even-indexed ones (low
    nibbles) and the odd-indexed ones (high nibbles), each [BLOCK_N, BLOCK_K / 2]."""
    factor = mx_factor(s)
    low, high = e2m1_pair(w)
    return low * factor, high * factor


@triton.jit
def _mx_product(w, s, xe, xo, DOT_F32: tl.constexpr, DOT_IN_DTYPE: tl.constexpr, dtype: tl.constexpr):
    # This step's [BLOCK_T, BLOCK_N] sums: two tl.dots over K / 2 (even and odd values), each value scaled.
    even, odd = decode_pairs(w, s)
    if DOT_IN_DTYPE:
        xe = xe.to(dtype)
        xo = xo.to(dtype)
        even = even.to(dtype)
        odd = odd.to(dtype)
    return tile_product(xe, even, True, DOT_F32) + tile_product(xo, odd, True, DOT_F32)


@triton.jit
def _channel_dot(xin, w, ACT: tl.constexpr, dtype: tl.constexpr):
    # x @ w.T in f32 for an 8-bit per-channel weight tile on the tensor cores. W8A8 multiplies its
    # 8-bit values as they are: int8 by int8 (exact int32 sums), e4m3 in f16 (exact; x comes as f16;
    # sm_90's mma.sync takes no e4m3, and one conversion per two weights to f16 is a third of what
    # bf16 or the f32 broadcast product costs the conversion units, which the weight stream would
    # saturate). With 16-bit x, both in x's dtype (int8 values are exact in bf16).
    if ACT == ACT_INT8:
        out = tl.dot(xin, tl.trans(w), out_dtype=tl.int32).to(tl.float32)
    elif ACT == ACT_FP8:
        out = tl.dot(xin.to(tl.float16), tl.trans(w.to(tl.float16)))
    else:
        out = tl.dot(xin.to(dtype), tl.trans(w.to(dtype)))
    return out


@triton.jit
def _qgemv_kernel(x_ptr, xs_ptr, nw_ptr, w_ptr, s_ptr, b_ptr, r_ptr, y_ptr, T, N, K, eps, x_st, w_st, s_st, r_st,
                  y_st, WEIGHT: tl.constexpr, ACT: tl.constexpr, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr,
                  HAS_RESIDUAL: tl.constexpr, DOT_F32: tl.constexpr,
                  DOT_IN_DTYPE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  PASS_K: tl.constexpr, PDL: tl.constexpr):
    # Program (q, p) computes rows q*BLOCK_T.. of output columns p*BLOCK_N..: the row blocks of one
    # column tile are neighbours in launch order, so all but the first read its weights from L2. The
    # next tile's loads go out before this one's arithmetic, as in gemv.py. With ACT, x holds the
    # 8-bit rows and xs_ptr their scales (the prologue is already applied: PROLOGUE is RAW).
    dtype = y_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < T
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_st
    pairs = tl.arange(0, BLOCK_K // 2)
    offs_k = tl.arange(0, BLOCK_K)
    w, s = load_weight(w_ptr, s_ptr, cols, N, w_st, s_st, 0, K, WEIGHT, BLOCK_K)
    await_previous_kernel(PDL)
    rstd = tl.zeros([BLOCK_T], tl.float32)
    if PROLOGUE == NORM:
        rstd = row_rstd(x_rows, row_mask, K, eps, BLOCK_T, PASS_K)
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    if WEIGHT == MXFP4:
        # x's pairs load in the step, after the next weight tile's loads went out: they come from L2,
        # and held a step ahead they would take as many registers as the bytes they multiply.
        for k0 in range(0, K, BLOCK_K):
            # x's even and odd elements at stride 2
            w_next, s_next = load_weight(w_ptr, s_ptr, cols, N, w_st, s_st, k0 + BLOCK_K, K, WEIGHT, BLOCK_K)
            xe, pe = input_tile(x_rows, nw_ptr, row_mask, k0 + 2 * pairs, K, PROLOGUE)
            xo, po = input_tile(x_rows, nw_ptr, row_mask, k0 + 2 * pairs + 1, K, PROLOGUE)
            x_even = tile_input(xe, pe, rstd, PROLOGUE, dtype)
            x_odd = tile_input(xo, po, rstd, PROLOGUE, dtype)
            acc += _mx_product(w, s, x_even, x_odd, DOT_F32, DOT_IN_DTYPE, dtype)
            w = w_next
            s = s_next
    else:
        xk, partner = input_tile(x_rows, nw_ptr, row_mask, offs_k, K, PROLOGUE)
        for k0 in range(0, K, BLOCK_K):
            w_next, s_next = load_weight(w_ptr, s_ptr, cols, N, w_st, s_st, k0 + BLOCK_K, K, WEIGHT, BLOCK_K)
            x_next, partner_next = input_tile(x_rows, nw_ptr, row_mask, k0 + BLOCK_K + offs_k, K, PROLOGUE)
            xin = tile_input(xk, partner, rstd, PROLOGUE, dtype)
            if DOT_IN_DTYPE:
                acc += _channel_dot(xin, w, ACT, dtype)
            else:
                acc += tile_product(xin, w, True, DOT_F32)
            w = w_next
            xk = x_next
            partner = partner_next
        acc *= tl.load(s_ptr + cols, mask=col_mask, other=0.0)[None, :]
    if ACT != ACT_NONE:
        acc *= tl.load(xs_ptr + rows, mask=row_mask, other=1.0)[:, None]
    gemv_epilogue(acc, b_ptr, r_ptr, y_ptr, rows, cols, row_mask, col_mask, r_st, y_st, dtype, HAS_BIAS, HAS_RESIDUAL)


@functools.lru_cache(maxsize=None)
def gemv_tiling(config: KernelConfig, pack: int) -> KernelConfig:
    # The bf16 GEMV's tiling with the quantized tile sizes: product elements in weight values, K steps
    # in weight bytes, ``pack`` values a byte (replace() validates every field: once per config and
    # pack); MXFP4's tl.dot step is a quarter as many values (see quantized_gemv_dot_block_k).
    least_k, most_k = config.quantized_gemv_block_k
    return replace(config, gemv_product_elements=config.quantized_gemv_product_elements,
                   gemv_programs_per_sm=config.quantized_gemv_programs_per_sm,
                   gemv_block_n=config.quantized_gemv_block_n, gemv_block_k=(least_k, most_k * pack),
                   gemv_dot_block_k=max(16, config.quantized_gemv_dot_block_k // pack ** 2))


def quantized_gemv_tiles(rows: int, n: int, k: int, sms: int, pack: int,
                         config: KernelConfig = DEFAULTS) -> tuple[int, int, int, int, int]:
    """(BLOCK_T, BLOCK_N, BLOCK_K, num_warps, num_stages) of the quantized GEMV for ``rows`` (2 or more)
    rows of an [n, k] weight stored ``pack`` values a byte (2: MXFP4)."""
    if rows > GEMV_MAX_ROWS:
        block_t = max(16, min(pow2(rows), config.quantized_gemv_block_t))
        block_n, block_k = config.quantized_gemm_block_n, min(config.quantized_gemm_block_k, pow2(k, 16))
        warps, stages = config.quantized_gemm_num_warps, config.quantized_gemm_num_stages
    else:
        cfg = gemv_config(rows, n, k, sms, gemv_tiling(config, pack))
        block_t, block_n, block_k = cfg.block_t, cfg.block_n, cfg.block_k
        warps, stages = config.quantized_gemv_num_warps, config.gemv_num_stages
    # An MX tile holds whole blocks of 32; a tl.dot needs 16 of K at least (block_k is a power of two).
    return block_t, block_n, max(block_k, MX_BLOCK if pack == 2 else 16), warps, stages


def launch_quantized_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out: torch.Tensor, *,
                          scheme: QuantScheme, act_quant: str | None, norm_weight: torch.Tensor | None = None,
                          gated: bool = False, bias: torch.Tensor | None = None,
                          residual: torch.Tensor | None = None, eps: float = 0.0,
                          config: KernelConfig = DEFAULTS) -> None:
    """``out = epilogue(act(prologue(x)) @ dequantize(weight).T)`` for checked operands
    (``linear_quantized_triton`` checks them): ``weight`` [N, K / pack] in ``scheme``'s storage,
    ``weight_scale`` its one scale tensor, the prologue and epilogue as ``gemv.launch_gemv``'s, for 2 or
    more rows (one row is ``gemv_quantized_row``'s). With ``act_quant`` two launches: the quantized rows
    (prologue applied), then the GEMV on them."""
    rows, n, k = x.shape[0], weight.shape[0], weight.shape[1] * scheme.pack
    if rows == 0 or n == 0:
        return
    mx = scheme.block is not None
    dot_f32 = dot_in_f32(x.dtype)
    x_scale = x
    prologue = NORM if norm_weight is not None else SILU_MUL if gated else RAW
    if act_quant is not None:
        x, x_scale = quantize_rows(x, act_quant, norm_weight=norm_weight, gated=gated, eps=eps, as_f16=True,
                                   config=config)
        prologue, norm_weight = RAW, None
    block_t, block_n, block_k, warps, stages = quantized_gemv_tiles(rows, n, k, sm_count(x), scheme.pack, config)
    res = residual if residual is not None else out
    grid = (triton.cdiv(rows, block_t), triton.cdiv(n, block_n))
    _qgemv_kernel[grid](
        x, x_scale, norm_weight if norm_weight is not None else x, weight, weight_scale,
        bias if bias is not None else out, res, out, rows, n, k, eps, x.stride(0), weight.stride(0),
        weight_scale.stride(0), res.stride(0), out.stride(0), WEIGHT=MXFP4 if mx else PER_CHANNEL,
        ACT=ACT_KINDS[act_quant], PROLOGUE=prologue, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        DOT_F32=dot_f32, DOT_IN_DTYPE=not dot_f32, BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k,
        PASS_K=min(pow2(k, 16), max(16, config.gemv_norm_pass_elements // block_t)),
        num_warps=warps, num_stages=stages, **pdl_launch(x, config.pdl))
