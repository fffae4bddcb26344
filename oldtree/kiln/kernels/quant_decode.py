"""Stored weight values read back in registers, for the Triton kernels that read quantized weights
(``gemv_quantized``, ``gemv_quantized_row``, ``gemm_quantized``'s dequantizer).

Every decode here is integer bit moves into an f32's bits, no conversion instructions: sm_90 runs
conversions (e4m3 -> f16 -> f32, i8 -> f32, f16 -> f32) at 16 a clock per SM, where a GEMV streaming
8-bit weights at 3 TB/s takes in ~13 values a clock per SM and MXFP4 ~26, so converting each value
would cap the stream below the memory's rate. The ``*_bits`` decodes leave out a power of two (the
bias difference between the stored exponent and f32's), which the caller folds into something it
multiplies anyway (x, a block's scale, the epilogue) rather than spending a multiply per value.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Weight kinds the kernels know (constexprs).
PER_CHANNEL = tl.constexpr(0)
MXFP4 = tl.constexpr(1)
MX_BLOCK = 32
# ``e4m3_bits`` reads a value as value * 2^-120 (f32's exponent bias 127, e4m3's 7).
E4M3_BITS_SHIFT = 120
# ``e2m1_bits`` reads a value as value * 2^-126 (f32's exponent bias 127, e2m1's 1).
E2M1_BITS_SHIFT = 126


@triton.jit
def e2m1_bits(w):
    """MXFP4 bytes as their two e2m1 values times 2^-126 in f32, (low nibble, high nibble): a code
    ``s e1 e0 m`` placed at f32's sign and at the lowest exponent bits and top mantissa bit reads as
    the code's value times 2^-126 (exponent 0 is subnormal in both formats)."""
    b = w.to(tl.int32)
    low = (((b & 0x8) << 28) | ((b & 0x7) << 22)).to(tl.float32, bitcast=True)
    high = (((b & 0x80) << 24) | ((b & 0x70) << 18)).to(tl.float32, bitcast=True)
    return low, high


@triton.jit
def e2m1_pair(w):
    """MXFP4 bytes as their two e2m1 values in f32, (low nibble, high nibble): ``e2m1_bits`` times 2^126."""
    low, high = e2m1_bits(w)
    return low * 8.507059173023462e37, high * 8.507059173023462e37  # 2^126


@triton.jit
def mx_factor(s):
    """An e8m0 scale as the f32 power of two 2^(e - 127), from its bits (e = 0, 2^-127, reads as 0: a
    block below 2^-124 in magnitude)."""
    return (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_bits(w):
    """fp8 e4m3 values as f32 times 2^-120: the byte, sign-extended, shifted so that its sign lands on
    bit 31 (the extension fills bits 27-30, masked off) and its exponent and mantissa on f32's lowest
    exponent bits and top mantissa bits; e4m3's subnormals land on f32's."""
    b = w.to(tl.int8, bitcast=True).to(tl.int32)
    return ((b << 20) & -2014314496).to(tl.float32, bitcast=True)  # 0x87F00000 as an int32


@triton.jit
def int8_value(w):
    """int8 values in f32 without a conversion: 1.5 * 2^23 + b is an f32 whose low mantissa bits are
    b's (an integer add to the bits), and one exact subtraction leaves b."""
    return (w.to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
