"""Per-token activation quantization on the device: each row of a GEMM's input rounded once to int8 or
fp8 e4m3 with its own f32 scale, as ``quantize.quantize_rows`` does, for the W8A8 GEMMs that read it.

A W8A8 GEMM multiplies 8-bit activations by 8-bit weights, and the activations' scales are dynamic
(each token's largest magnitude maps to the type's limit). That needs a pass over the whole row before
any value can be rounded, so the row is quantized here, once per GEMM, by one program per row, and the
GEMM (``gemv_quantized``'s GEMV at few rows, ``_scaled_mm`` / ``_int_mm`` at many) reads the 8-bit
values and the scale. The GEMM's prologue (RMSNorm or SiLU·mul, ``gemv.py``'s helpers) is applied
here, rounded to the activation dtype as the unfused graph rounds it, so the GEMM's input is never
written out in 16 bits. A row of up to ``KernelConfig.act_quant_block_k`` values is read once and
held in registers; a wider one is read three times (rstd, magnitude, values).

Rounding matches torch bit for bit: int8 rounds half to even; fp8 on the GPU is the hardware's
round-to-nearest-even conversion, and under Triton's interpreter (whose fp8 casts round ties away and
do not carry into the next binade) the same rounding written out in f32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import DEFAULTS, KernelConfig
from .gemv import NORM, RAW, SILU_MUL, input_tile, row_rstd, tile_input
from .triton_support import INTERPRET, await_previous_kernel, pdl_launch, pow2

# The activation quantizations the kernels know (constexprs), by the IR's ``act_quant`` name.
ACT_NONE = tl.constexpr(0)
ACT_INT8 = tl.constexpr(1)
ACT_FP8 = tl.constexpr(2)
ACT_KINDS = {None: ACT_NONE, "int8_per_token": ACT_INT8, "fp8_per_token": ACT_FP8}
ACT_DTYPES = {"int8_per_token": torch.int8, "fp8_per_token": torch.float8_e4m3fn}
# Whether e4m3 rounding uses the hardware conversion: everywhere but the interpreter.
HARDWARE_FP8 = not INTERPRET


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
    # step is 2^(exponent - 3), the subnormals' 2^-9. Multiplying by the step's reciprocal (a power of
    # two, built from its bits) is exact, as dividing by the step would be.
    exponent = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 255) - 127, -6) - 3
    step = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - exponent) << 23).to(tl.float32, bitcast=True)
    return _round_half_even(v * inverse) * step


@triton.jit
def quantize_act(v, ACT: tl.constexpr, HARDWARE: tl.constexpr):
    """``v`` (f32, already divided by its row's scale) rounded to ACT's 8-bit type (int8 or e4m3)."""
    if ACT == ACT_INT8:
        q = _round_half_even(tl.minimum(tl.maximum(v, -127.0), 127.0)).to(tl.int8)
    elif HARDWARE:  # cvt.rn.satfinite: round to nearest even, as torch's cast
        q = tl.minimum(tl.maximum(v, -448.0), 448.0).to(tl.float8e4nv)
    else:
        q = _round_to_e4m3(tl.minimum(tl.maximum(v, -448.0), 448.0)).to(tl.float8e4nv)  # exact: on the grid
    return q


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
             BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr = 1):
    # The largest magnitude of each of BLOCK_T rows of the GEMM's input (the prologue applied, rounded
    # as in the unfused graph), for rows wider than one tile.
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_T], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xk, partner = input_tile(x_rows, nw_ptr, row_mask, k0 + offs, K, PROLOGUE)
        v = tile_input(xk, partner, rstd, PROLOGUE, dtype).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
    return amax


@triton.jit
def _quantize_rows_kernel(x_ptr, nw_ptr, q_ptr, s_ptr, K, eps, x_st, q_st, PROLOGUE: tl.constexpr,
                          ACT: tl.constexpr, HARDWARE: tl.constexpr, BLOCK_K: tl.constexpr,
                          ONE_TILE: tl.constexpr, PDL: tl.constexpr):
    # One program per row: its rstd (RMSNorm prologue), its largest magnitude, then the quantized row.
    dtype = x_ptr.dtype.element_ty
    row = tl.program_id(0)
    row_mask = tl.full([1], 1, tl.int1)
    x_rows = x_ptr + row.to(tl.int64) * x_st + tl.zeros([1, 1], tl.int64)
    q_row = q_ptr + row.to(tl.int64) * q_st
    offs = tl.arange(0, BLOCK_K)
    await_previous_kernel(PDL)
    rstd = tl.zeros([1], tl.float32)
    if ONE_TILE:  # the whole row in registers: one read
        xk, partner = input_tile(x_rows, nw_ptr, row_mask, offs, K, PROLOGUE)
        if PROLOGUE == NORM:
            xf = xk.to(tl.float32)
            rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / K + eps)
        v = tile_input(xk, partner, rstd, PROLOGUE, dtype).to(tl.float32)
        scale = act_scale(tl.max(tl.abs(v), axis=1), ACT)
        q = quantize_act(tl.math.div_rn(v, scale[:, None]), ACT, HARDWARE)
        tl.store(q_row + offs[None, :], q.to(q_ptr.dtype.element_ty), mask=(offs < K)[None, :])
    else:
        if PROLOGUE == NORM:
            rstd = row_rstd(x_rows, row_mask, K, eps, 1, BLOCK_K)
        scale = act_scale(row_amax(x_rows, nw_ptr, row_mask, K, rstd, PROLOGUE, dtype, BLOCK_K), ACT)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs
            xk, partner = input_tile(x_rows, nw_ptr, row_mask, k, K, PROLOGUE)
            v = tile_input(xk, partner, rstd, PROLOGUE, dtype).to(tl.float32)
            q = quantize_act(tl.math.div_rn(v, scale[:, None]), ACT, HARDWARE)
            tl.store(q_row + k[None, :], q.to(q_ptr.dtype.element_ty), mask=(k < K)[None, :])
    tl.store(s_ptr + row + tl.arange(0, 1), scale)


def quantize_rows(x: torch.Tensor, act_quant: str, *, norm_weight: torch.Tensor | None = None, gated: bool = False,
                  eps: float = 0.0, as_f16: bool = False,
                  config: KernelConfig = DEFAULTS) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMM input made from ``x`` (``rmsnorm(x)``, ``silu(gate) * up`` or x) quantized per row to
    ``act_quant``'s type: the values [T, K] and the f32 scales [T, 1]. ``as_f16`` writes fp8 values
    as f16 (exactly: e4m3 is a subset of f16), for a GEMM that would convert them for every tile."""
    rows, k = x.shape[0], x.shape[1] // (2 if gated else 1)
    dtype = torch.float16 if as_f16 and act_quant == "fp8_per_token" else ACT_DTYPES[act_quant]
    q = torch.empty(rows, k, dtype=dtype, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        prologue = NORM if norm_weight is not None else SILU_MUL if gated else RAW
        block_k = min(pow2(k, 16), config.act_quant_block_k)
        _quantize_rows_kernel[(rows,)](x, norm_weight if norm_weight is not None else x, q, scale, k, eps,
                                       x.stride(0), q.stride(0), PROLOGUE=prologue, ACT=ACT_KINDS[act_quant],
                                       HARDWARE=HARDWARE_FP8, BLOCK_K=block_k, ONE_TILE=block_k >= k,
                                       num_warps=config.act_quant_num_warps, **pdl_launch(x, config.pdl))
    return q, scale
