"""GEMMs fused with their neighbours: ``rmsnorm_linear``, ``rmsnorm_linear_silu_mul``, ``linear_residual``.

At decode's few rows (``T <= GEMV_MAX_ROWS``) the Triton implementations are one GEMV launch that
reads the weights once and applies the RMSNorm before (a prologue over the tiny ``[T, K]`` input) and
the bias, residual add or SiLU gate after (an epilogue on the accumulator). At more rows they compose
the unfused fast paths instead (Triton rmsnorm, cuBLAS, Triton silu_mul): the GEMM is then compute
bound and cuBLAS is the better kernel. The row count is a host fact (the input's shape), never a
device value, so the decode path can be captured in a CUDA graph.

The GEMV rounds where the unfused graph does: the normalized input and the GEMM output are rounded
to the activation dtype before the next step uses them. The composed linear_residual (cuBLAS addmm)
rounds GEMM + residual once instead, at most an ulp from the unfused graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import triton
import triton.language as tl

from kiln.ir.types import TensorType

from .elementwise import ref_silu_mul, triton_silu_mul
from .linear import ref_linear
from .norm import ref_rmsnorm, triton_rmsnorm
from .registry import Checker, register_impl
from .triton_support import (IR_FLOATS, await_previous_kernel, dot_in_f32, pdl_launch, pow2, require,
                             require_device, require_float, require_unit_last_stride, sm_count)


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

# Where the fused GEMV runs: few rows and small weights. Measured on an H200 (bench/kernels.py,
# 2026-12-02): weights of a few MB are latency-bound, and one launch (~3-5 us) beats cuBLAS plus the
# separate norm and activation kernels (~4 us + ~1.5 us each); weights of tens of MB are
# bandwidth-bound, and there cuBLAS streams at 74-100% of the copy rate where this GEMV reached
# 34-68%. Above either bound the op composes Triton norm/activation kernels with cuBLAS.
GEMV_MAX_ROWS = 16
GEMV_MAX_WEIGHT_BYTES = 16 << 20
# Tuning knobs of gemv_config. The weights are read once whatever the tiling, so the tiles only
# need to keep every SM busy: at least GEMV_PROGRAMS_PER_SM column tiles per SM (no split-K:
# partial sums added in a second pass or by atomics would change the rounding or the determinism).
GEMV_PROGRAMS_PER_SM = 2
GEMV_BLOCK_N = (4, 64)  # least and most weight rows (output columns) per program
GEMV_BLOCK_K = (64, 512)  # least and most of K per step; contiguous runs that load as wide vectors
# Broadcast product [rows, BLOCK_N, BLOCK_K] per step: 64 f32 a thread at 4 warps.
GEMV_PRODUCT_ELEMENTS = 8192
GEMV_DOT_BLOCK_K = 128  # the tl.dot path (rows padded to 16) steps through K by this much
# Up to this K a one-row program takes all of K in one step (when the tile fits the product budget),
# so its weight and input loads are all in flight at once: no loop, no second pass over x for the
# norm. Measured on an H200 at SmolLM2's shapes: 1.5-2.8 us a GEMV, against 2.5-4.7 us looping.
GEMV_ONE_STEP_MAX_K = 2048
GEMV_NUM_WARPS = 4
GEMV_NUM_STAGES = 3

# Epilogue kinds; constexprs so that the kernel may read them.
_PLAIN = tl.constexpr(0)
_RESIDUAL = tl.constexpr(1)
_SILU_MUL = tl.constexpr(2)


@dataclass(frozen=True)
class GemvConfig:
    """The tiles of one GEMV launch: padded rows, output columns per program, K per step."""
    block_t: int
    block_n: int
    block_k: int
    use_dot: bool


def uses_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the fused GEMV (rather than the cuBLAS composition) runs for these operands."""
    return x.shape[0] <= GEMV_MAX_ROWS and weight.numel() * weight.element_size() <= GEMV_MAX_WEIGHT_BYTES


def gemv_config(rows: int, n: int, k: int, sms: int) -> GemvConfig:
    """Tiles for ``rows`` (<= GEMV_MAX_ROWS) rows of output ``n`` columns wide over ``k``."""
    # One row: a broadcast multiply and sum over K. More: rows padded to 16 for tl.dot (the
    # broadcast product over 2-8 rows measured 5-10x slower than the padded tl.dot).
    use_dot = rows > 1
    block_t = 16 if use_dot else 1
    least_n = 16 if use_dot else GEMV_BLOCK_N[0]
    most_n = GEMV_BLOCK_N[1] if use_dot else GEMV_PRODUCT_ELEMENTS // GEMV_BLOCK_K[0]
    block_n = max(least_n, min(GEMV_BLOCK_N[1], most_n))
    # The widest tile that still gives every SM its programs: wider tiles reload x less often.
    while block_n > least_n and triton.cdiv(n, block_n) < sms * GEMV_PROGRAMS_PER_SM:
        block_n //= 2
    whole_k = pow2(k, 16)
    if use_dot:
        # Measured on an H200: all of K in one tl.dot step (its operands in shared memory) ran 3-10x
        # slower than stepping through K.
        block_k = GEMV_DOT_BLOCK_K
    elif whole_k <= GEMV_ONE_STEP_MAX_K and block_n * whole_k <= GEMV_PRODUCT_ELEMENTS:
        block_k = whole_k
    else:
        block_k = max(GEMV_BLOCK_K[0], min(GEMV_BLOCK_K[1], GEMV_PRODUCT_ELEMENTS // block_n))
    return GemvConfig(block_t, block_n, min(block_k, whole_k), use_dot)


@triton.jit
def _tile_product(x, w, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr):
    # x: [BLOCK_T, BLOCK_K] in the activation dtype; w: [BLOCK_N, BLOCK_K]. Returns x @ w.T in f32.
    if USE_DOT:
        if DOT_F32:
            return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        return tl.dot(x, tl.trans(w))
    return tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _gemv_kernel(x_ptr, nw_ptr, w_ptr, b_ptr, r_ptr, y_ptr, T, N, K, eps, x_st, w_st, r_st, y_st,
                 NORM: tl.constexpr, HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr,
                 USE_DOT: tl.constexpr, DOT_F32: tl.constexpr, ONE_STEP: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    # Program j computes output columns j*BLOCK_N .. +BLOCK_N of every row. For _SILU_MUL, N is the
    # output width I, and the program also reads the up rows I + n of the [2I, K] weight.
    dtype = x_ptr.dtype.element_ty
    rows = tl.arange(0, BLOCK_T)
    row_mask = rows < T
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_st
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * w_st
    up_rows = w_ptr + (cols + N).to(tl.int64)[:, None] * w_st  # read only for _SILU_MUL
    if ONE_STEP:
        # All of K in one step: the weight loads go out first, even before waiting for the kernel
        # before this one (weights are never written during a step, so reading them early is safe):
        # under PDL their fetch from memory overlaps that kernel's tail. x is read once, after the wait.
        k = offs_k
        k_mask = k < K
        w_mask = col_mask[:, None] & k_mask[None, :]
        w = tl.load(w_rows + k[None, :], mask=w_mask, other=0.0)
        if EPILOGUE == _SILU_MUL:
            w_up = tl.load(up_rows + k[None, :], mask=w_mask, other=0.0)
        await_previous_kernel(PDL)
        xk = tl.load(x_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if NORM:
            xf = xk.to(tl.float32)
            xk = _normalize(xk, tl.math.rsqrt(tl.sum(xf * xf, axis=1) / K + eps), nw_ptr, k, k_mask, dtype)
        acc = _tile_product(xk, w, USE_DOT, DOT_F32)
        acc_up = acc
        if EPILOGUE == _SILU_MUL:
            acc_up = _tile_product(xk, w_up, USE_DOT, DOT_F32)
    else:
        await_previous_kernel(PDL)
        acc, acc_up = _gemv_k_loop(x_rows, w_rows, up_rows, nw_ptr, row_mask, col_mask, offs_k, K, eps, dtype, NORM,
                                   EPILOGUE == _SILU_MUL, USE_DOT, DOT_F32, BLOCK_T, BLOCK_N, BLOCK_K)
    _gemv_epilogue(acc, acc_up, b_ptr, r_ptr, y_ptr, rows, cols, row_mask, col_mask, r_st, y_st, dtype,
                   HAS_BIAS, EPILOGUE)


@triton.jit
def _normalize(xk, rstd, nw_ptr, k, k_mask, dtype: tl.constexpr):
    # As ref_rmsnorm: normalize in f32, round, scale by the weight, round again.
    normed = (xk.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)
    nw = tl.load(nw_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
    return (normed * nw[None, :]).to(dtype)


@triton.jit
def _gemv_k_loop(x_rows, w_rows, up_rows, nw_ptr, row_mask, col_mask, offs_k, K, eps, dtype: tl.constexpr,
                 NORM: tl.constexpr, GATED: tl.constexpr, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # K in steps of BLOCK_K; with the norm, a first pass over the (tiny) x finds each row's rstd.
    # Returns the f32 products with the weight rows and, when GATED, with the up rows.
    if NORM:
        # Each program finds the rows' rstd itself: x is a few KB, and one launch beats two.
        sum_sq = tl.zeros([BLOCK_T], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            xk = tl.load(x_rows + k[None, :], mask=row_mask[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
            sum_sq += tl.sum(xk * xk, axis=1)
        rstd = tl.math.rsqrt(sum_sq / K + eps)
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        xk = tl.load(x_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if NORM:
            xk = _normalize(xk, rstd, nw_ptr, k, k_mask, dtype)
        w_mask = col_mask[:, None] & k_mask[None, :]
        w = tl.load(w_rows + k[None, :], mask=w_mask, other=0.0)
        acc += _tile_product(xk, w, USE_DOT, DOT_F32)
        if GATED:
            w_up = tl.load(up_rows + k[None, :], mask=w_mask, other=0.0)
            acc_up += _tile_product(xk, w_up, USE_DOT, DOT_F32)
    return acc, acc_up


@triton.jit
def _gemv_epilogue(acc, acc_up, b_ptr, r_ptr, y_ptr, rows, cols, row_mask, col_mask, r_st, y_st, dtype: tl.constexpr,
                   HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr):
    if HAS_BIAS:
        # cuBLAS adds the bias to the f32 accumulator and rounds once; so does this.
        acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_mask = row_mask[:, None] & col_mask[None, :]
    if EPILOGUE == _RESIDUAL:
        # The unfused graph rounds the GEMM's output before the add.
        r = tl.load(r_ptr + rows.to(tl.int64)[:, None] * r_st + cols[None, :], mask=out_mask, other=0.0)
        acc = acc.to(dtype).to(tl.float32) + r.to(tl.float32)
    elif EPILOGUE == _SILU_MUL:
        # gate and up are rounded as the GEMM's output, silu(gate) as its own op's, as in triton_silu_mul.
        gate = acc.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        acc = silu * acc_up.to(dtype).to(tl.float32)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * y_st + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_mask)


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


def _launch_gemv(x: torch.Tensor, norm_weight: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
                 residual: torch.Tensor | None, out: torch.Tensor, eps: float, epilogue: int) -> None:
    rows, k = x.shape
    n = out.shape[1]
    if rows == 0 or n == 0:
        return
    cfg = gemv_config(rows, n, k, sm_count(x))
    # Absent inputs are never read (their constexpr flag is off); any tensor stands in for the pointer.
    res = residual if residual is not None else out
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, norm_weight if norm_weight is not None else x, weight, bias if bias is not None else x, res, out,
        rows, n, k, eps, x.stride(0), weight.stride(0), res.stride(0), out.stride(0),
        NORM=norm_weight is not None, HAS_BIAS=bias is not None, EPILOGUE=epilogue,
        USE_DOT=cfg.use_dot, DOT_F32=dot_in_f32(x.dtype), ONE_STEP=cfg.block_k >= k, BLOCK_T=cfg.block_t,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=GEMV_NUM_WARPS, num_stages=GEMV_NUM_STAGES,
        **pdl_launch(x))


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
        _launch_gemv(x, norm_weight, weight, bias, None, out, eps, _PLAIN.value)


def triton_rmsnorm_linear_silu_mul(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, *,
                                   out: torch.Tensor, eps: float) -> None:
    kernel = "triton.rmsnorm_linear_silu_mul"
    require(weight.dim() == 2 and weight.shape[0] % 2 == 0, kernel,
            lambda: f"weight {tuple(weight.shape)} must stack gate and up rows (an even count)")
    _check_gemv(kernel, x, norm_weight, weight, [], out, weight.shape[0] // 2)
    if not uses_gemv(x, weight):
        composed_rmsnorm_linear_silu_mul(x, norm_weight, weight, out=out, eps=eps)
    else:
        _launch_gemv(x, norm_weight, weight, None, None, out, eps, _SILU_MUL.value)


def triton_linear_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, *,
                           out: torch.Tensor) -> None:
    n = weight.shape[0]
    _check_gemv("triton.linear_residual", x, None, weight, [("residual", residual, (x.shape[0], n))], out, n)
    if not uses_gemv(x, weight):
        composed_linear_residual(x, weight, residual, out=out)
    else:
        _launch_gemv(x, None, weight, None, residual, out, 0.0, _RESIDUAL.value)


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
