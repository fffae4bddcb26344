"""GEMMs reading a quantized weight: the ``ref_`` torch versions of every linear-family op, one
implementation per weight scheme (``torch.linear.int8_channel``, ...), picked by the weight's format.

The weight is dequantized (``quantize.dequantize``: per output channel, or per MX block of 32); an
op whose ``act_quant`` is set first rounds the GEMM's input per token (``quantize.quantize_rows``), as
a W8A8 kernel that quantizes its activations at run time sees them; the GEMM runs in f32 and its
result is rounded to the activation dtype, where the plain op's reference would round it. They run everywhere and are what faster kernels are tested against.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

import torch

from kiln.ir.types import TensorType
from kiln.ir.weights import SCHEMES, QuantizedType, QuantScheme

from .elementwise import ref_silu_mul
from .linear import ref_linear
from .norm import ref_rmsnorm
from .quantize import dequantize, quantize_rows
from .registry import Checker, register_impl

Scales = tuple[torch.Tensor, ...]


def ref_quantized_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scales: Scales,
                         scheme: QuantScheme, act_quant: str | None = None) -> torch.Tensor:
    """In f32, rounded to x's dtype once at the end: a quantized GEMM multiplies the 8-bit values
    exactly (integer or f32 accumulation) and applies the scales in f32, never in bf16."""
    x32 = x.float() if act_quant is None else quantize_rows(x, act_quant)
    bias32 = None if bias is None else bias.float()
    return ref_linear(x32, dequantize(weight, scales, scheme), bias32).to(x.dtype)


def _linear(x, weight, bias=None, *, out, weight_scales, scheme, act_quant=None):
    out.copy_(ref_quantized_linear(x, weight, bias, weight_scales, scheme, act_quant))


def _rmsnorm_linear(x, norm_weight, weight, bias=None, *, out, eps, weight_scales, scheme, act_quant=None):
    # The unfused rmsnorm's output has x's type (an f32 norm weight would otherwise promote it).
    normed = ref_rmsnorm(x, norm_weight, eps).to(x.dtype)
    out.copy_(ref_quantized_linear(normed, weight, bias, weight_scales, scheme, act_quant))


def _linear_residual(x, weight, residual, *, out, weight_scales, scheme, act_quant=None):
    out.copy_(ref_quantized_linear(x, weight, None, weight_scales, scheme, act_quant) + residual)


def _silu_mul_linear_residual(gate_up, weight, residual, *, out, weight_scales, scheme, act_quant=None):
    _linear_residual(ref_silu_mul(*gate_up.chunk(2, dim=-1)), weight, residual, out=out,
                     weight_scales=weight_scales, scheme=scheme, act_quant=act_quant)


def _weight_in(scheme: QuantScheme, index: int) -> Checker:
    """Takes a node whose input ``index`` (its weight) is quantized with ``scheme``."""

    def check(types: Sequence[TensorType], attrs: Mapping[str, Any]) -> bool:
        weight = types[index]
        return isinstance(weight, QuantizedType) and weight.format.scheme == scheme

    return check


# op -> (its fn, the index of its weight input). Above the plain torch references, which cannot read one.
_OPS: dict[str, tuple[Callable[..., None], int]] = {
    "linear": (_linear, 1),
    "rmsnorm_linear": (_rmsnorm_linear, 2),
    "linear_residual": (_linear_residual, 1),
    "silu_mul_linear_residual": (_silu_mul_linear_residual, 1),
}
for _op, (_fn, _index) in _OPS.items():
    for _scheme in SCHEMES.values():
        register_impl(_op, "torch", functools.partial(_fn, scheme=_scheme), checker=_weight_in(_scheme, _index),
                      priority=10, name=f"torch.{_op}.{_scheme.name}")
