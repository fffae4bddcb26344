"""Quantized GEMMs at many rows (prefill, large decode batches) through the GPU's library GEMMs.

Above a few rows a GEMM is compute bound and the tensor-core libraries are the better kernels:

- fp8 weights with fp8 activations: ``torch._scaled_mm`` with rowwise scales (each token's scale times
  each channel's, applied in its f32 epilogue; compute capability 8.9 or later, bf16 output);
- int8 weights with int8 activations: ``torch._int_mm`` (exact int32 sums), scaled in f32 after;
- weight-only schemes (w8a16_int8, mxfp4): the weight dequantized to the activation dtype by a Triton
  kernel into a scratch tensor, then the plain GEMM (cuBLAS) with its fusions composed as
  ``linear_fused`` composes them. This is the simple prefill path: one extra write and read of the
  16-bit weight per GEMM, small beside the GEMM's arithmetic at hundreds of rows.

The activations of the first two are quantized per token by ``act_quant_triton``'s kernel, which also
applies the GEMM's prologue (RMSNorm or SiLU·mul), so a W8A8 GEMM at many rows is that kernel plus
the library call. Each runs only on CUDA tensors; ``library_path`` says whether
one fits the operands (dtypes, alignment, device), else the Triton GEMV takes any row count.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kiln.ir.weights import QuantScheme

from .act_quant_triton import quantize_rows
from .config import DEFAULTS, KernelConfig
from .gemv_quantized import decode_pairs, load_weight
from .linear_fused import composed_linear_residual, composed_rmsnorm_linear, composed_silu_mul_linear_residual
from .quant_decode import MXFP4, PER_CHANNEL
from .triton_support import pow2

SCALED_MM, INT_MM, DEQUANTIZED = "scaled_mm", "int_mm", "dequantized"


def library_path(x: torch.Tensor, weight: torch.Tensor, scheme: QuantScheme, act_quant: str | None) -> str | None:
    """Which library GEMM runs these operands on the GPU, or None where none fits: ``_scaled_mm`` needs
    bf16 activations and K, N multiples of 16; ``_int_mm`` more than 16 rows and K, N multiples of 8."""
    if x.device.type != "cuda":
        return None
    n, k = weight.shape[0], weight.shape[1] * scheme.pack
    if act_quant is None:
        return DEQUANTIZED
    if (scheme.name, act_quant) == ("fp8_channel", "fp8_per_token"):
        return SCALED_MM if x.dtype == torch.bfloat16 and k % 16 == 0 and n % 16 == 0 else None
    if (scheme.name, act_quant) == ("int8_channel", "int8_per_token"):
        return INT_MM if x.shape[0] > 16 and k % 8 == 0 and n % 8 == 0 else None
    return None  # mixed weight and activation types: the Triton GEMV takes them


# --- dequantization -------------------------------------------------------------------------------


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, out_ptr, N, K, w_st, s_st, out_st, WEIGHT: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    w, s = load_weight(w_ptr, s_ptr, cols, N, w_st, s_st, k0, K, WEIGHT, BLOCK_K)
    out_rows = out_ptr + cols.to(tl.int64)[:, None] * out_st
    if WEIGHT == MXFP4:
        # The low nibbles are the even columns, the high ones the odd: interleaved in registers so that
        # the row is stored contiguously (two stores at stride 2 write every sector twice).
        even, odd = decode_pairs(w, s)
        values = tl.interleave(even, odd)
    else:
        values = w.to(tl.float32) * tl.load(s_ptr + cols, mask=cols < N, other=0.0)[:, None]
    k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_rows + k[None, :], values.to(out_ptr.dtype.element_ty), mask=(cols < N)[:, None] & (k < K)[None, :])


def dequantize_weight(weight: torch.Tensor, weight_scale: torch.Tensor, scheme: QuantScheme,
                      dtype: torch.dtype) -> torch.Tensor:
    """``quantize.dequantize`` on the device, rounded to ``dtype``: [N, K] from the stored [N, K / pack]."""
    n, k = weight.shape[0], weight.shape[1] * scheme.pack
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    block_n, block_k = 16, min(pow2(k, 32), 256)
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        weight, weight_scale, out, n, k, weight.stride(0), weight_scale.stride(0), out.stride(0),
        WEIGHT=MXFP4 if scheme.block is not None else PER_CHANNEL, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out


# --- the library GEMMs -----------------------------------------------------------------------------


def library_gemm(path: str, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out: torch.Tensor, *,
                 scheme: QuantScheme, act_quant: str | None, norm_weight: torch.Tensor | None = None,
                 gated: bool = False, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                 eps: float = 0.0, config: KernelConfig = DEFAULTS) -> None:
    """``gemv_quantized.launch_quantized_gemv``'s result through the library GEMM ``path``
    (``library_path``'s answer)."""
    if path == DEQUANTIZED:
        dense = dequantize_weight(weight, weight_scale, scheme, x.dtype)
        if norm_weight is not None:
            composed_rmsnorm_linear(x, norm_weight, dense, bias, out=out, eps=eps, config=config)
        elif gated:
            composed_silu_mul_linear_residual(x, dense, residual, out=out, config=config)
        elif residual is not None:
            composed_linear_residual(x, dense, residual, out=out)
        elif bias is not None:
            torch.addmm(bias, x, dense.t(), out=out)
        else:
            torch.matmul(x, dense.t(), out=out)
        return
    q, x_scale = quantize_rows(x, act_quant, norm_weight=norm_weight, gated=gated, eps=eps, config=config)
    if path == SCALED_MM:
        scaled_mm = functools.partial(torch._scaled_mm, q, weight.t(), scale_a=x_scale,
                                      scale_b=weight_scale.view(1, -1), out_dtype=torch.bfloat16)
        if bias is None and residual is None and out.is_contiguous():
            scaled_mm(out=out)  # the GEMM's output is the op's: no copy
            return
        product = scaled_mm()
    else:
        # int32 sums are exact; the scales multiply in f32 and the result rounds once, as the reference.
        scaled = torch._int_mm(q, weight.t()).float().mul_(x_scale).mul_(weight_scale)
        product = (scaled.add_(bias.float()) if bias is not None else scaled).to(out.dtype)
        bias = None
    # The bias after _scaled_mm's rounding (at most an ulp from the reference's one rounding); the
    # residual after the GEMM's rounding, as the unfused graph adds it.
    if bias is not None:
        product = product + bias
    if residual is not None:
        torch.add(product, residual, out=out)
    else:
        out.copy_(product)
