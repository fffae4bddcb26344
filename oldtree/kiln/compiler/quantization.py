"""The quantization registry: each scheme a compile may apply, by SGLang's name.

A ``QuantizationMethod`` says what the ``quantize`` pass does to a model: the weight format its
linear-family GEMMs get (a ``QuantScheme`` of ``kiln.ir.weights``), the ``Quantize`` recipe that
makes those weights at compile time, the ops it rewrites and how those ops then treat their
activations (``act_quant``: quantized per token at run time, or left as they are). The kernels
that run them are the registry's (``kiln/kernels/linear_quantized.py``), chosen by the weight's
format and the op's ``act_quant``.

    fp8         FP8 e4m3 weights per output channel; activations per token, dynamic
    w8a8_int8   INT8 weights per output channel; activations per token, dynamic
    w8a16_int8  INT8 weights per output channel; activations as they are (weight-only)
    mxfp4       OCP MXFP4 weights (blocks of 32, e8m0 scales); weight-only
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.ir import Param, TensorType, WeightFormat
from kiln.ir.weights import SCHEMES, QuantScheme

from .recipes import Quantize

# The ops whose weight (the input named "weight") a method quantizes: every GEMM the fusions leave.
LINEAR_FAMILY = ("linear", "rmsnorm_linear", "linear_residual", "silu_mul_linear_residual")


@dataclass(frozen=True)
class QuantizationMethod:
    name: str
    scheme: QuantScheme
    act_quant: str | None  # the ops' ``act_quant`` attribute (kiln.ir.weights.ACT_QUANT); None: weight-only
    ops: tuple[str, ...] = LINEAR_FAMILY

    def quantized(self, weight: Param) -> tuple[Param, tuple[Param, ...], Quantize] | None:
        """``weight`` in this method's format: the stored parameter (named ``{weight}.q``), its scale
        parameters (``{weight}.q.scale``) and the recipe making them; None when its shape does not fit
        the scheme (an MXFP4 row that is no whole number of blocks)."""
        rows, width = weight.type.shape
        if not isinstance(width, int) or width % self.scheme.pack:
            return None
        stored = TensorType((rows, width // self.scheme.pack), self.scheme.storage)
        try:
            (scale_type,) = self.scheme.scale_types(stored)
        except ValueError:
            return None
        name = f"{weight.name}.q"
        scale = Param(f"{name}.scale", scale_type)
        fmt = WeightFormat(self.scheme, (scale.name,))
        return Param(name, stored, fmt, weight.placement), (scale,), Quantize(name, weight.name, fmt)


METHODS: dict[str, QuantizationMethod] = {m.name: m for m in (
    QuantizationMethod("fp8", SCHEMES["fp8_channel"], "fp8_per_token"),
    QuantizationMethod("w8a8_int8", SCHEMES["int8_channel"], "int8_per_token"),
    QuantizationMethod("w8a16_int8", SCHEMES["int8_channel"], None),
    QuantizationMethod("mxfp4", SCHEMES["mxfp4"], None),
)}


def get_method(name: str) -> QuantizationMethod:
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown quantization {name!r}; supported: {', '.join(METHODS)}") from None
