"""GEMMs fused with their neighbours: ``rmsnorm_linear``, ``rmsnorm_linear_silu_mul``, ``linear_residual``.

At decode's few rows (``T <= GEMV_MAX_ROWS``) the Triton implementations are one GEMV launch
(``gemv.py``) that reads the weights once and applies the RMSNorm before (a prologue over the tiny ``[T, K]`` input) and
the bias, residual add or SiLU gate after (an epilogue on the accumulator). At more rows they compose
the unfused fast paths instead (Triton rmsnorm, cuBLAS, Triton silu_mul): the GEMM is then compute
bound and cuBLAS is the better kernel. The row count is a host fact (the input's shape), never a
device value, so the decode path can be captured in a CUDA graph.

The GEMV rounds where the unfused graph does: the normalized input and the GEMM output are rounded
to the activation dtype before the next step uses them. The composed linear_residual (cuBLAS addmm)
rounds GEMM + residual once instead, at most an ulp from the unfused graph.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from kiln.ir.types import TensorType

from .elementwise import ref_silu_mul, triton_silu_mul
from .gemv import GEMV_MAX_ROWS, PLAIN, RESIDUAL, SILU_MUL, launch_gemv
from .linear import ref_linear
from .norm import ref_rmsnorm, triton_rmsnorm
from .registry import Checker, register_impl
from .triton_support import IR_FLOATS, require, require_device, require_float, require_unit_last_stride


def ref_rmsnorm_linear(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    # The unfused rmsnorm's output has x's type (an f32 norm weight would otherwise promote it).
    return ref_linear(ref_rmsnorm(x, norm_weight, eps).to(x.dtype), weight, bias)


def ref_rmsnorm_linear_silu_mul(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> torch.Tensor:
    gate, up = ref_rmsnorm_linear(x, norm_weight, weight, None, eps).chunk(2, dim=-1)
    return ref_silu_mul(gate, up)


def ref_linear_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return ref_linear(x, weight) + residual


def _rmsnorm_linear(x, norm_weight, weight, bias=None, *, out, eps):
    out.copy_(ref_rmsnorm_linear(x, norm_weight, weight, bias, eps))


def _rmsnorm_linear_silu_mul(x, norm_weight, weight, *, out, eps):
    out.copy_(ref_rmsnorm_linear_silu_mul(x, norm_weight, weight, eps))


def _linear_residual(x, weight, residual, *, out):
    out.copy_(ref_linear_residual(x, weight, residual))


register_impl("rmsnorm_linear", "torch", _rmsnorm_linear)
register_impl("rmsnorm_linear_silu_mul", "torch", _rmsnorm_linear_silu_mul)
register_impl("linear_residual", "torch", _linear_residual)


# --- Triton GEMV ------------------------------------------------------------------------------------

# Where the fused GEMV (gemv.py) runs instead of the composition (Triton norm and activation kernels
# around cuBLAS): for one row up to GEMV_ONE_ROW_MAX_WEIGHT_BYTES of weights, for 2-GEMV_MAX_ROWS
# rows up to GEMV_MAX_WEIGHT_BYTES. Measured on an H200 (bench/gemv_sweep.py, bench/step_breakdown.py):
# at one row the GEMV streams Llama-3-8B's qkv, o and down weights faster than cuBLAS, which also
# needs a split-K reduce and the norm kernels beside it; at 8-16 rows its tl.dot path is slower than
# cuBLAS on weights of tens of MB, and small weights are latency-bound, where one launch wins.
GEMV_MAX_WEIGHT_BYTES = 16 << 20
GEMV_ONE_ROW_MAX_WEIGHT_BYTES = 128 << 20


def uses_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the fused GEMV (rather than the cuBLAS composition) runs for these operands."""
    weight_bytes = weight.numel() * weight.element_size()
    if x.shape[0] == 1:
        return weight_bytes <= GEMV_ONE_ROW_MAX_WEIGHT_BYTES
    return x.shape[0] <= GEMV_MAX_ROWS and weight_bytes <= GEMV_MAX_WEIGHT_BYTES


def _check_gemv(kernel: str, x: torch.Tensor, norm_weight: torch.Tensor | None, weight: torch.Tensor,
                extras: Sequence[tuple[str, torch.Tensor, tuple[int, ...]]], out: torch.Tensor, out_cols: int) -> None:
    """Checks the inputs of any of the three ops; ``extras`` are (name, tensor, shape) of bias or residual."""
    require(x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], kernel,
            lambda: f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [T, K] and [N, K]")
    require_float(kernel, "x", x)
    rows, k = x.shape
    named = [("weight", weight, tuple(weight.shape)), *extras, ("out", out, (rows, out_cols))]
    if norm_weight is not None:
        named.append(("norm_weight", norm_weight, (k,)))
    for name, t, shape in named:
        require(tuple(t.shape) == shape and t.dtype == x.dtype, kernel,
                lambda: f"{name} {tuple(t.shape)} {t.dtype} must be {list(shape)} {x.dtype}")
        require_unit_last_stride(kernel, name, t)
    require_unit_last_stride(kernel, "x", x)
    require_device(kernel, x, *(t for _, t, _ in named))


# The compositions for many rows; public so that the benchmark can time them against the fused GEMV.

def composed_rmsnorm_linear(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None = None, *, out: torch.Tensor, eps: float) -> None:
    normed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    triton_rmsnorm(x, norm_weight, out=normed, eps=eps)
    if bias is None:
        torch.matmul(normed, weight.t(), out=out)
    else:
        torch.addmm(bias, normed, weight.t(), out=out)


def composed_rmsnorm_linear_silu_mul(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, *,
                                     out: torch.Tensor, eps: float) -> None:
    both = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    composed_rmsnorm_linear(x, norm_weight, weight, out=both, eps=eps)
    gate, up = both.chunk(2, dim=-1)
    triton_silu_mul(gate, up, out=out)


def composed_linear_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, *,
                             out: torch.Tensor) -> None:
    # One rounding of GEMM + residual where the unfused graph rounds twice: at most an ulp apart.
    torch.addmm(residual, x, weight.t(), out=out)


def triton_rmsnorm_linear(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None = None, *, out: torch.Tensor, eps: float) -> None:
    n = weight.shape[0]
    extras = [("bias", bias, (n,))] if bias is not None else []
    _check_gemv("triton.rmsnorm_linear", x, norm_weight, weight, extras, out, n)
    if not uses_gemv(x, weight):
        composed_rmsnorm_linear(x, norm_weight, weight, bias, out=out, eps=eps)
    else:
        launch_gemv(x, norm_weight, weight, bias, None, out, eps, PLAIN.value)


def triton_rmsnorm_linear_silu_mul(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, *,
                                   out: torch.Tensor, eps: float) -> None:
    kernel = "triton.rmsnorm_linear_silu_mul"
    require(weight.dim() == 2 and weight.shape[0] % 2 == 0, kernel,
            lambda: f"weight {tuple(weight.shape)} must stack gate and up rows (an even count)")
    _check_gemv(kernel, x, norm_weight, weight, [], out, weight.shape[0] // 2)
    if not uses_gemv(x, weight):
        composed_rmsnorm_linear_silu_mul(x, norm_weight, weight, out=out, eps=eps)
    else:
        launch_gemv(x, norm_weight, weight, None, None, out, eps, SILU_MUL.value)


def triton_linear_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, *,
                           out: torch.Tensor) -> None:
    n = weight.shape[0]
    _check_gemv("triton.linear_residual", x, None, weight, [("residual", residual, (x.shape[0], n))], out, n)
    if not uses_gemv(x, weight):
        composed_linear_residual(x, weight, residual, out=out)
    else:
        launch_gemv(x, None, weight, None, residual, out, 0.0, RESIDUAL.value)


def _floats_like_x(weight_index: int) -> Checker:
    """Takes 2-D x and weight with every input in x's float dtype (an f32 norm weight on bf16
    activations goes to the reference)."""

    def check(types: Sequence[TensorType], attrs: Mapping[str, Any]) -> bool:
        x, weight = types[0], types[weight_index]
        return (x.dtype in IR_FLOATS and x.rank == 2 and weight.rank == 2
                and all(t.dtype == x.dtype for t in types))

    return check


register_impl("rmsnorm_linear", "triton", triton_rmsnorm_linear, checker=_floats_like_x(2), priority=10)
register_impl("rmsnorm_linear_silu_mul", "triton", triton_rmsnorm_linear_silu_mul, checker=_floats_like_x(2),
              priority=10)
register_impl("linear_residual", "triton", triton_linear_residual, checker=_floats_like_x(1), priority=10)
