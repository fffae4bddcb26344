"""GEMMs fused with their neighbours: ``rmsnorm_linear``, ``linear_residual``, ``silu_mul_linear_residual``;
and ``linear`` alone, for GEMMs that no fusion takes (an MoE router shares its normed input with the
experts, so its norm stays apart): at decode the same GEMV, a PDL launch, instead of cuBLAS.

At decode's few rows (``T <= GEMV_MAX_ROWS``) the Triton implementations are one GEMV launch
(``gemv.py``) that reads the weights once and applies the RMSNorm or the SiLU gate before (a
prologue over the tiny input) and the bias or residual add after (an epilogue on the accumulator).
At more rows they compose the unfused fast paths instead (Triton rmsnorm or silu_mul, cuBLAS): the
GEMM is then compute bound and cuBLAS is the better kernel. (``gemv_mma``'s tensor-core GEMV on bf16
weights, the prologue applied to x's tiles, measured 1.4x cuBLAS's time at 5 and 9 rows of Llama-3-8B's
layer on an H100, so it is not used here.) The row count is a host fact (the input's shape), never a
device value, so the decode path can be captured in a CUDA graph.

The GEMV rounds where the unfused graph does: the normalized input, silu(gate) * up and the GEMM
output are rounded to the activation dtype before the next step uses them. The composed residual
ops (cuBLAS addmm) round GEMM + residual once instead, at most an ulp from the unfused graph.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from kiln.ir.types import TensorType

from .config import DEFAULTS, KernelConfig
from .elementwise import ref_silu_mul, triton_silu_mul
from .gemv import GEMV_MAX_ROWS
from .gemv_few_rows import launch_gemv_for_rows
from .linear import ref_linear, torch_linear
from .norm import ref_rmsnorm, triton_rmsnorm
from .registry import Checker, register_impl
from .triton_support import IR_FLOATS, require, require_device, require_float, require_unit_last_stride


def ref_rmsnorm_linear(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    # The unfused rmsnorm's output has x's type (an f32 norm weight would otherwise promote it).
    return ref_linear(ref_rmsnorm(x, norm_weight, eps).to(x.dtype), weight, bias)


def ref_linear_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return ref_linear(x, weight) + residual


def ref_silu_mul_linear_residual(gate_up: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return ref_linear_residual(ref_silu_mul(*gate_up.chunk(2, dim=-1)), weight, residual)


def _rmsnorm_linear(x, norm_weight, weight, bias=None, *, out, eps):
    out.copy_(ref_rmsnorm_linear(x, norm_weight, weight, bias, eps))


def _linear_residual(x, weight, residual, *, out):
    out.copy_(ref_linear_residual(x, weight, residual))


def _silu_mul_linear_residual(gate_up, weight, residual, *, out):
    out.copy_(ref_silu_mul_linear_residual(gate_up, weight, residual))


register_impl("rmsnorm_linear", "torch", _rmsnorm_linear)
register_impl("linear_residual", "torch", _linear_residual)
register_impl("silu_mul_linear_residual", "torch", _silu_mul_linear_residual)


# --- Triton GEMV ------------------------------------------------------------------------------------


def uses_gemv(x: torch.Tensor, weight: torch.Tensor, config: KernelConfig = DEFAULTS) -> bool:
    """Whether the fused GEMV (rather than the composition: Triton norm and activation kernels around
    cuBLAS) runs for these operands: for one row (or up to ``config.gemv_few_rows_max``) up to
    ``config.gemv_one_row_max_weight_bytes`` of weights, for more up to GEMV_MAX_ROWS rows up to
    ``config.gemv_max_weight_bytes``. At one row the GEMV
    streams Llama-3-8B's qkv, o and down weights faster than cuBLAS, which also needs a split-K
    reduce and the norm kernels beside it (bench/experiments/gemv_sweep.py measures both)."""
    weight_bytes = weight.numel() * weight.element_size()
    if x.shape[0] <= max(1, config.gemv_few_rows_max):  # one row, or the few-row GEMV's
        return weight_bytes <= config.gemv_one_row_max_weight_bytes
    return x.shape[0] <= GEMV_MAX_ROWS and weight_bytes <= config.gemv_max_weight_bytes


def _check_gemv(kernel: str, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, *,
                norm_weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, gated: bool = False) -> None:
    """Checks the operands of any of the three ops: x is [T, K] ([T, 2K] of gate and up when
    ``gated``), weight [N, K], and the rest shaped to match, of x's dtype, unit last stride."""
    x_name, k = ("gate_up" if gated else "x"), weight.shape[-1]
    require(x.dim() == 2 and weight.dim() == 2 and x.shape[1] == (2 if gated else 1) * k, kernel,
            lambda: f"{x_name} {tuple(x.shape)} and weight {tuple(weight.shape)} must be "
                    f"[T, {'2K' if gated else 'K'}] and [N, K]")
    require_float(kernel, x_name, x)
    out_shape = (x.shape[0], weight.shape[0])
    named = [("weight", weight, tuple(weight.shape)), ("out", out, out_shape)]
    for name, t, shape in (("norm_weight", norm_weight, (k,)), ("bias", bias, out_shape[1:]),
                           ("residual", residual, out_shape)):
        if t is not None:
            named.append((name, t, shape))
    for name, t, shape in named:
        require(tuple(t.shape) == shape and t.dtype == x.dtype, kernel,
                lambda: f"{name} {tuple(t.shape)} {t.dtype} must be {list(shape)} {x.dtype}")
        require_unit_last_stride(kernel, name, t)
    require_unit_last_stride(kernel, x_name, x)
    require_device(kernel, x, *(t for _, t, _ in named))


# The compositions for many rows; public so that the benchmark can time them against the fused GEMV.

def composed_rmsnorm_linear(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None = None, *, out: torch.Tensor, eps: float,
                            config: KernelConfig = DEFAULTS) -> None:
    normed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    triton_rmsnorm(x, norm_weight, out=normed, eps=eps, config=config)
    if bias is None:
        torch.matmul(normed, weight.t(), out=out)
    else:
        torch.addmm(bias, normed, weight.t(), out=out)


def composed_linear_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, *,
                             out: torch.Tensor) -> None:
    # One rounding of GEMM + residual where the unfused graph rounds twice: at most an ulp apart.
    torch.addmm(residual, x, weight.t(), out=out)


def composed_silu_mul_linear_residual(gate_up: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, *,
                                      out: torch.Tensor, config: KernelConfig = DEFAULTS) -> None:
    activated = torch.empty(gate_up.shape[0], weight.shape[1], dtype=gate_up.dtype, device=gate_up.device)
    triton_silu_mul(*gate_up.chunk(2, dim=-1), out=activated, config=config)
    composed_linear_residual(activated, weight, residual, out=out)


def triton_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, out: torch.Tensor,
                  config: KernelConfig = DEFAULTS) -> None:
    _check_gemv("triton.linear", x, weight, out, bias=bias)
    if not uses_gemv(x, weight, config):
        torch_linear(x, weight, bias, out=out)
    else:
        launch_gemv_for_rows(x, weight, out, bias=bias, config=config)


def triton_rmsnorm_linear(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None = None, *, out: torch.Tensor, eps: float,
                          config: KernelConfig = DEFAULTS) -> None:
    _check_gemv("triton.rmsnorm_linear", x, weight, out, norm_weight=norm_weight, bias=bias)
    if not uses_gemv(x, weight, config):
        composed_rmsnorm_linear(x, norm_weight, weight, bias, out=out, eps=eps, config=config)
    else:
        launch_gemv_for_rows(x, weight, out, norm_weight=norm_weight, bias=bias, eps=eps, config=config)


def triton_linear_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, *,
                           out: torch.Tensor, config: KernelConfig = DEFAULTS) -> None:
    _check_gemv("triton.linear_residual", x, weight, out, residual=residual)
    if not uses_gemv(x, weight, config):
        composed_linear_residual(x, weight, residual, out=out)
    else:
        launch_gemv_for_rows(x, weight, out, residual=residual, config=config)


def triton_silu_mul_linear_residual(gate_up: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, *,
                                    out: torch.Tensor, config: KernelConfig = DEFAULTS) -> None:
    _check_gemv("triton.silu_mul_linear_residual", gate_up, weight, out, residual=residual, gated=True)
    if not uses_gemv(gate_up, weight, config):
        composed_silu_mul_linear_residual(gate_up, weight, residual, out=out, config=config)
    else:
        launch_gemv_for_rows(gate_up, weight, out, gated=True, residual=residual, config=config)


def _floats_like_x(weight_index: int) -> Checker:
    """Takes 2-D x and weight with every input in x's float dtype (an f32 norm weight on bf16
    activations goes to the reference)."""

    def check(types: Sequence[TensorType], attrs: Mapping[str, Any]) -> bool:
        x, weight = types[0], types[weight_index]
        return (x.dtype in IR_FLOATS and x.rank == 2 and weight.rank == 2
                and all(t.dtype == x.dtype for t in types))

    return check


register_impl("linear", "triton", triton_linear, checker=_floats_like_x(1), priority=10, wants_config=True)
register_impl("rmsnorm_linear", "triton", triton_rmsnorm_linear, checker=_floats_like_x(2), priority=10,
              wants_config=True)
register_impl("linear_residual", "triton", triton_linear_residual, checker=_floats_like_x(1), priority=10,
              wants_config=True)
register_impl("silu_mul_linear_residual", "triton", triton_silu_mul_linear_residual, checker=_floats_like_x(1),
              priority=10, wants_config=True)
