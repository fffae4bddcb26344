"""The triton backend's linear-family ops on quantized weights: every fusion of ``linear_fused`` kept.

``linear``, ``rmsnorm_linear``, ``linear_residual`` and ``silu_mul_linear_residual`` on an
``int8_channel``, ``fp8_channel`` or ``mxfp4`` weight (one implementation per op and scheme,
``triton.<op>.<scheme>``, taken by the registry above the ``torch.<op>.<scheme>`` references, which
stay the CPU path and the fallback). Each call picks its kernel from host facts, so a decode step
stays capturable in a CUDA graph:

- W8A8 at up to ``KernelConfig.mma_gemv_max_rows`` rows on Hopper: ``gemv_mma``'s tensor-core GEMV
  (the activations quantized by a launch of their own, or in it with ``mma_gemv_quantizes``);
- else few rows (``KernelConfig.quantized_gemv_max_rows`` with activations quantized per token,
  ``quantized_weight_only_max_rows`` weight-only), or no library GEMM fits, or under Triton's
  interpreter: the quantized GEMV, the prologue and epilogue fused: ``gemv_quantized_row`` at one row
  (one launch, W8A8's activations quantized in it), ``gemv_quantized`` at more;
- more rows on the GPU: ``gemm_quantized``'s library GEMMs (``_scaled_mm``, ``_int_mm``, or the
  weight dequantized for cuBLAS).

FP8 needs compute capability 8.9 or later (the e4m3 conversions and ``_scaled_mm``): on an older GPU
the launcher says so and names the reference backend (``--backend torch``) instead of failing deep in
Triton's compiler.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

import torch

from kiln.ir.types import TensorType
from kiln.ir.weights import SCHEMES, QuantizedType, QuantScheme
from kiln.tensors import torch_dtype

from .act_quant_triton import ACT_KINDS
from .config import DEFAULTS, KernelConfig
from .gemm_quantized import library_gemm, library_path
from .gemv_quantized import launch_quantized_gemv
from .gemv_mma import launch_mma_gemv, runs_mma_gemv
from .gemv_quantized_row import launch_quantized_row_gemv
from .registry import Checker, register_impl
from .triton_support import INTERPRET, IR_FLOATS, device_capability, require, require_device, require_float, \
    require_unit_last_stride

Scales = tuple[torch.Tensor, ...]
# The schemes these kernels read (a scheme added to SCHEMES later is not claimed until a kernel reads it).
KERNEL_SCHEMES = ("int8_channel", "fp8_channel", "mxfp4")


def _check(kernel: str, x: torch.Tensor, weight: torch.Tensor, scales: Scales, out: torch.Tensor, *,
           scheme: QuantScheme, act_quant: str | None, norm_weight: torch.Tensor | None = None,
           bias: torch.Tensor | None = None, residual: torch.Tensor | None = None, gated: bool = False) -> None:
    """x [T, K] ([T, 2K] of gate and up when ``gated``), weight [N, K / pack] in the scheme's storage
    with its one scale tensor, the rest in x's dtype, every last stride 1, one device."""
    x_name = "gate_up" if gated else "x"
    require(act_quant in ACT_KINDS, kernel, lambda: f"act_quant {act_quant!r} is none of {list(ACT_KINDS)}")
    require(x.dim() == 2 and weight.dim() == 2, kernel,
            lambda: f"{x_name} {tuple(x.shape)} and weight {tuple(weight.shape)} must be 2-D")
    require_float(kernel, x_name, x)
    storage = torch_dtype(scheme.storage)
    require(weight.dtype == storage, kernel, lambda: f"a {scheme} weight is {storage}, got {weight.dtype}")
    n, k = weight.shape[0], weight.shape[1] * scheme.pack
    require(x.shape[1] == (2 if gated else 1) * k, kernel,
            lambda: f"{x_name} {tuple(x.shape)} must be [T, {'2K' if gated else 'K'}] for weight [N, K] = [{n}, {k}]")
    require(len(scales) == 1, kernel, lambda: f"{scheme} takes one scale tensor, got {len(scales)}")
    (scale,) = scales
    if scheme.block is None:
        require(scale.dtype == torch.float32 and tuple(scale.shape) == (n,) and scale.stride(0) == 1, kernel,
                lambda: f"weight scale {tuple(scale.shape)} {scale.dtype} must be contiguous f32 [{n}]")
    else:
        require(scale.dtype == torch.uint8 and tuple(scale.shape) == (n, k // scheme.block), kernel,
                lambda: f"mxfp4 scale {tuple(scale.shape)} {scale.dtype} must be uint8 [{n}, {k // scheme.block}]")
    named = [("out", out, (x.shape[0], n))]
    for name, t, shape in (("norm_weight", norm_weight, (k,)), ("bias", bias, (n,)),
                           ("residual", residual, (x.shape[0], n))):
        if t is not None:
            named.append((name, t, shape))
    for name, t, shape in named:
        require(tuple(t.shape) == shape and t.dtype == x.dtype, kernel,
                lambda: f"{name} {tuple(t.shape)} {t.dtype} must be {list(shape)} {x.dtype}")
    for name, t in [(x_name, x), ("weight", weight), ("weight scale", scale)] + [(nm, t) for nm, t, _ in named]:
        require_unit_last_stride(kernel, name, t)
    require_device(kernel, x, weight, scale, *(t for _, t, _ in named))
    if not INTERPRET and (scheme.name == "fp8_channel" or act_quant == "fp8_per_token"):
        major, minor = device_capability(x)
        require((major, minor) >= (8, 9), kernel,
                lambda: f"FP8 needs a GPU of compute capability 8.9 or later (Ada, Hopper); this one is "
                        f"{major}.{minor}. Compile with --backend torch to run the reference kernels instead")


def _run(kernel: str, x: torch.Tensor, weight: torch.Tensor, scales: Scales, out: torch.Tensor, *,
         scheme: QuantScheme, act_quant: str | None, config: KernelConfig, **fused: Any) -> None:
    _check(kernel, x, weight, scales, out, scheme=scheme, act_quant=act_quant,
           **{name: value for name, value in fused.items() if name != "eps"})
    most = config.quantized_gemv_max_rows if act_quant is not None else config.quantized_weight_only_max_rows
    path = library_path(x, weight, scheme, act_quant) if x.shape[0] > most else None
    if runs_mma_gemv(x, act_quant, config):
        launch_mma_gemv(x, weight, scales[0], out, act_quant=act_quant, config=config, **fused)
    elif x.shape[0] == 1:
        launch_quantized_row_gemv(x, weight, scales[0], out, scheme=scheme, act_quant=act_quant, config=config,
                                  **fused)
    elif path is None:
        launch_quantized_gemv(x, weight, scales[0], out, scheme=scheme, act_quant=act_quant, config=config, **fused)
    else:
        library_gemm(path, x, weight, scales[0], out, scheme=scheme, act_quant=act_quant, config=config, **fused)


def triton_quantized_linear(x, weight, bias=None, *, out, weight_scales, scheme, act_quant=None, config=DEFAULTS):
    _run(f"triton.linear.{scheme}", x, weight, weight_scales, out, scheme=scheme, act_quant=act_quant,
         config=config, bias=bias)


def triton_quantized_rmsnorm_linear(x, norm_weight, weight, bias=None, *, out, eps, weight_scales, scheme,
                                    act_quant=None, config=DEFAULTS):
    _run(f"triton.rmsnorm_linear.{scheme}", x, weight, weight_scales, out, scheme=scheme, act_quant=act_quant,
         config=config, norm_weight=norm_weight, bias=bias, eps=eps)


def triton_quantized_linear_residual(x, weight, residual, *, out, weight_scales, scheme, act_quant=None,
                                     config=DEFAULTS):
    _run(f"triton.linear_residual.{scheme}", x, weight, weight_scales, out, scheme=scheme, act_quant=act_quant,
         config=config, residual=residual)


def triton_quantized_silu_mul_linear_residual(gate_up, weight, residual, *, out, weight_scales, scheme,
                                              act_quant=None, config=DEFAULTS):
    _run(f"triton.silu_mul_linear_residual.{scheme}", gate_up, weight, weight_scales, out, scheme=scheme,
         act_quant=act_quant, config=config, residual=residual, gated=True)


def _takes(scheme: QuantScheme, weight_index: int) -> Checker:
    """Takes 2-D float x with every other float input in x's dtype, a 2-D weight quantized with
    ``scheme`` and an ``act_quant`` the kernels know."""

    def check(types: Sequence[TensorType], attrs: Mapping[str, Any]) -> bool:
        x, weight = types[0], types[weight_index]
        others = [t for i, t in enumerate(types) if i != weight_index]
        return (isinstance(weight, QuantizedType) and weight.format.scheme == scheme and weight.rank == 2
                and x.dtype in IR_FLOATS and x.rank == 2 and all(t.dtype == x.dtype for t in others)
                and attrs.get("act_quant") in ACT_KINDS)

    return check


# op -> (its fn, the index of its weight input)
_OPS: dict[str, tuple[Callable[..., None], int]] = {
    "linear": (triton_quantized_linear, 1),
    "rmsnorm_linear": (triton_quantized_rmsnorm_linear, 2),
    "linear_residual": (triton_quantized_linear_residual, 1),
    "silu_mul_linear_residual": (triton_quantized_silu_mul_linear_residual, 1),
}
for _op, (_fn, _index) in _OPS.items():
    for _name in KERNEL_SCHEMES:
        _scheme = SCHEMES[_name]
        register_impl(_op, "triton", functools.partial(_fn, scheme=_scheme), checker=_takes(_scheme, _index),
                      priority=20, name=f"triton.{_op}.{_name}", wants_config=True)
