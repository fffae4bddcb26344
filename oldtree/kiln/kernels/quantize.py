"""Reference quantizers: each scheme of ``kiln.ir.weights.SCHEMES`` encoded and decoded once, in torch,
and the per-token activation quantization of ``kiln.ir.weights.ACT_QUANT``.

``quantize(weight, scheme)`` gives the stored values and the scale tensors the scheme's format names
(the compiler's ``Quantize`` weight recipe calls it at compile time); ``dequantize`` reads them back,
which is what a kernel reading a quantized weight must compute. Rows are every axis but the last; the
8-bit channel schemes scale each row by its largest magnitude, the block schemes (mxfp4, fp8_block128,
int8_block32) each block of a row.
``quantize_rows`` rounds activations the way a W8A8 GEMM sees them (each token scaled by its own
largest magnitude at run time). They live with the kernels because the runtime, which never imports
the compiler, runs the ``ref_`` kernels built on them.
"""

from __future__ import annotations

from typing import Callable

import torch

from kiln.ir.weights import QuantScheme

Scales = tuple[torch.Tensor, ...]

# The magnitudes of the eight non-negative e2m1 (fp4) codes; bit 3 of a code is the sign.
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
MX_BLOCK = 32


def quantize(weight: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, Scales]:
    return _SCHEMES[scheme.name][0](weight.float())


def dequantize(stored: torch.Tensor, scales: Scales, scheme: QuantScheme) -> torch.Tensor:
    """The f32 weight ``stored`` and ``scales`` encode."""
    return _SCHEMES[scheme.name][1](stored, scales)


def quantize_rows(x: torch.Tensor, act_quant: str) -> torch.Tensor:
    """``x`` quantized per row (token) to ``act_quant``'s 8-bit type and read back, in f32: what a GEMM
    that quantizes its activations dynamically computes with."""
    scheme = _ACTIVATIONS[act_quant]
    stored, scales = _SCHEMES[scheme][0](x.float())
    return _per_channel_decode(stored, scales)


def _per_channel(limit: float, dtype: torch.dtype) -> Callable[[torch.Tensor], tuple[torch.Tensor, Scales]]:
    """Each row scaled so that its largest magnitude becomes ``limit``; an all-zero row gets scale 1."""

    def encode(w: torch.Tensor) -> tuple[torch.Tensor, Scales]:
        amax = w.abs().amax(dim=-1)
        scale = torch.where(amax > 0, amax / limit, torch.ones_like(amax))
        scaled = (w / scale[..., None]).clamp(-limit, limit)
        return (scaled.round() if dtype == torch.int8 else scaled).to(dtype), (scale,)

    return encode


def _per_channel_decode(stored: torch.Tensor, scales: Scales) -> torch.Tensor:
    return stored.float() * scales[0][..., None]


def _per_block(limit: float, dtype: torch.dtype, block: int) -> Callable[[torch.Tensor], tuple[torch.Tensor, Scales]]:
    """Each ``block`` values of a row scaled as ``_per_channel`` scales a row."""
    encode_rows = _per_channel(limit, dtype)

    def encode(w: torch.Tensor) -> tuple[torch.Tensor, Scales]:
        stored, (scale,) = encode_rows(w.reshape(*w.shape[:-1], -1, block))
        return stored.reshape(w.shape), (scale,)

    return encode


def _per_block_decode(block: int) -> Callable[[torch.Tensor, Scales], torch.Tensor]:
    def decode(stored: torch.Tensor, scales: Scales) -> torch.Tensor:
        blocks = stored.reshape(*stored.shape[:-1], -1, block)
        return _per_channel_decode(blocks, scales).reshape(stored.shape)

    return decode


def _mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, Scales]:
    """OCP microscaling fp4: a block's shared exponent puts its largest magnitude in e2m1's top binade
    (4 to 6, so floor(log2(amax)) - 2); each value rounds to the nearest e2m1 magnitude (a tie to the
    smaller), values beyond 6 to 6. Two codes a byte, the even-indexed value in the low nibble; the
    exponent is stored biased by 127 (e8m0)."""
    blocks = w.reshape(*w.shape[:-1], -1, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.zeros_like(amax)).clamp(-127, 127)
    scaled = blocks / torch.exp2(exponent)[..., None]
    magnitude = (scaled.abs()[..., None] - E2M1.to(w.device)).abs().argmin(dim=-1)  # w may be on a GPU
    codes = (magnitude | ((scaled < 0).long() << 3)).reshape(w.shape).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), ((exponent + 127).to(torch.uint8),)


def _mxfp4_decode(stored: torch.Tensor, scales: Scales) -> torch.Tensor:
    """E2M1 read from its bits (exponent ``code >> 1 & 3``, mantissa ``code & 1``; exponent 0 is
    subnormal) rather than by indexing ``E2M1``: no host tensor, so it runs on any device and in a
    CUDA graph."""
    codes = torch.stack((stored & 15, stored >> 4), dim=-1).reshape(*stored.shape[:-1], -1).long()
    exponent, mantissa = ((codes >> 1) & 3).float(), (codes & 1).float()
    magnitude = torch.where(exponent == 0, 0.5 * mantissa, torch.exp2(exponent - 1) * (1 + 0.5 * mantissa))
    values = magnitude * (1 - 2 * (codes >> 3))
    blocks = values.reshape(*values.shape[:-1], -1, MX_BLOCK) * torch.exp2(scales[0].float() - 127)[..., None]
    return blocks.reshape(values.shape)


_FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
_SCHEMES = {
    "int8_channel": (_per_channel(127.0, torch.int8), _per_channel_decode),
    "fp8_channel": (_per_channel(_FP8_MAX, torch.float8_e4m3fn), _per_channel_decode),
    "mxfp4": (_mxfp4, _mxfp4_decode),
    "fp8_block128": (_per_block(_FP8_MAX, torch.float8_e4m3fn, 128), _per_block_decode(128)),
    "int8_block32": (_per_block(127.0, torch.int8, 32), _per_block_decode(32)),
}
# Per-token activations use the per-channel weight encoders: a token is a row of x as a channel is a row of w.
_ACTIVATIONS = {"int8_per_token": "int8_channel", "fp8_per_token": "fp8_channel"}
