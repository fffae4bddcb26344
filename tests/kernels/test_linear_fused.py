"""Triton rmsnorm_linear, rmsnorm_linear_silu_mul and linear_residual against their torch references,
on the fused GEMV (T <= GEMV_MAX_ROWS) and on the composed path (more rows)."""

from __future__ import annotations

import itertools

import pytest
import torch

from kiln.ir.types import DType, TensorType
from kiln.kernels import get_impl, select_impl
from kiln.kernels.gemv import (GEMV_BLOCK_K, GEMV_BLOCK_N, GEMV_MAX_ROWS, GEMV_PRODUCT_ELEMENTS, GEMV_PROGRAMS_PER_SM,
                               gemv_config)
from kiln.kernels.linear_fused import (ref_linear_residual, ref_rmsnorm_linear,
                                       ref_rmsnorm_linear_silu_mul, triton_linear_residual, triton_rmsnorm_linear,
                                       triton_rmsnorm_linear_silu_mul)

from .conftest import TOLERANCES

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (T, K, N): the broadcast GEMV (T = 1) and the tl.dot GEMV (T 2-16), each with K in one masked step
# or in several (K 3000), and the composed path (T > 16); N both below and above one program's columns.
CASES = [(1, 72, 24), (1, 3000, 40), (2, 1000, 40), (3, 200, 100), (5, 3000, 24), (7, 576, 100),
         (12, 200, 100), (16, 576, 960), (17, 72, 24), (40, 576, 960)]
EPS = 1e-5

# The conftest tolerances, but bf16 looser: Triton's interpreter truncates f32 -> bf16 instead of
# rounding, so most of the normalized inputs sit an ulp from the reference's; K such flips add up to
# ~0.03 on GEMM outputs of unit scale, and silu(gate) * up scales those errors by its operands. A
# wrong tile, row or missing step is off by far more.
_TOLERANCES = {**TOLERANCES, torch.bfloat16: dict(rtol=4e-2, atol=5e-2)}


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert not torch.isnan(actual).any(), "the kernel left elements of its output unwritten (NaN poison)"
    torch.testing.assert_close(actual.float(), expected.float(), **_TOLERANCES[actual.dtype])


def _strided(rows: int, cols: int, dtype: torch.dtype, device: str, scale: float = 1.0) -> torch.Tensor:
    """[rows, cols] as the middle third of a wider tensor: row stride 3 * cols, unit last stride."""
    return (torch.randn(rows, 3 * cols, device=device) * scale).to(dtype)[:, cols:2 * cols]


def _weight(n: int, k: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    # Scaled as initializations are, so outputs are of unit scale whatever K.
    return (torch.randn(n, k, device=device) * k ** -0.5).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("tokens,k,n", CASES)
def test_rmsnorm_linear(tokens, k, n, has_bias, dtype, device, poisoned):
    x = _strided(tokens, k, dtype, device, scale=3.0)
    norm_weight = torch.randn(k, device=device).to(dtype)
    weight = _weight(n, k, dtype, device)
    bias = torch.randn(n, device=device).to(dtype) if has_bias else None
    out = poisoned((tokens, n), dtype)
    triton_rmsnorm_linear(x, norm_weight, weight, bias, out=out, eps=EPS)
    _assert_close(out, ref_rmsnorm_linear(x, norm_weight, weight, bias, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,k,n", CASES)
def test_rmsnorm_linear_silu_mul(tokens, k, n, dtype, device, poisoned):
    x = _strided(tokens, k, dtype, device)
    norm_weight = torch.randn(k, device=device).to(dtype)
    weight = _weight(n, k, dtype, device)
    out = poisoned((tokens, n // 2), dtype)
    triton_rmsnorm_linear_silu_mul(x, norm_weight, weight, out=out, eps=EPS)
    _assert_close(out, ref_rmsnorm_linear_silu_mul(x, norm_weight, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,k,n", CASES)
def test_linear_residual(tokens, k, n, dtype, device, poisoned):
    x = _strided(tokens, k, dtype, device)
    weight = _weight(n, k, dtype, device)
    residual = _strided(tokens, n, dtype, device, scale=2.0)
    out = poisoned((tokens, n), dtype)
    triton_linear_residual(x, weight, residual, out=out)
    _assert_close(out, ref_linear_residual(x, weight, residual))


@pytest.mark.parametrize("impl", ["triton.linear_residual", "torch.linear_residual"])
@pytest.mark.parametrize("tokens,k,n", [(1, 3000, 40), (5, 576, 100), (40, 576, 960)])
def test_linear_residual_may_write_over_its_residual(tokens, k, n, impl, device):
    # The memory plan gives linear_residual's output the residual's storage where the residual is
    # read last (OpDef.reuses): every implementation must read each residual element before writing it.
    x = _strided(tokens, k, torch.float32, device)
    weight = _weight(n, k, torch.float32, device)
    residual = torch.randn(tokens, n, device=device)
    expected = ref_linear_residual(x, weight, residual.clone())
    get_impl(impl).fn(x, weight, residual, out=residual)
    _assert_close(residual, expected)


@pytest.mark.parametrize("tokens", [1, 3])
def test_large_weights_take_the_composed_path(tokens, device, poisoned, monkeypatch):
    import kiln.kernels.linear_fused as linear_fused

    x, norm_weight = torch.randn(tokens, 72, device=device), torch.randn(72, device=device)
    weight, residual = _weight(48, 72, torch.float32, device), torch.randn(tokens, 48, device=device)
    assert linear_fused.uses_gemv(x, weight)
    # One row has its own bound (the GEMV streams large weights well at one row, not at several).
    bound = "GEMV_ONE_ROW_MAX_WEIGHT_BYTES" if tokens == 1 else "GEMV_MAX_WEIGHT_BYTES"
    monkeypatch.setattr(linear_fused, bound, weight.numel() * 4 - 1)
    assert not linear_fused.uses_gemv(x, weight)
    out = poisoned((tokens, 24), torch.float32)
    triton_rmsnorm_linear_silu_mul(x, norm_weight, weight, out=out, eps=EPS)
    _assert_close(out, ref_rmsnorm_linear_silu_mul(x, norm_weight, weight, EPS))
    out = poisoned((tokens, 48), torch.float32)
    triton_linear_residual(x, weight, residual, out=out)
    _assert_close(out, ref_linear_residual(x, weight, residual))


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096),
                                 (960, 576), (576, 576), (1536, 576), (576, 1536), (49152, 576)])
def test_gemv_tiles_fill_an_h200(n, k):
    sms = 132
    for rows, gated in itertools.product(range(1, GEMV_MAX_ROWS + 1), (False, True)):
        cfg = gemv_config(rows, n, k, sms, gated)
        assert cfg.block_t >= rows and cfg.block_n >= min(rows, 16) and cfg.block_k >= GEMV_BLOCK_K[0]
        assert cfg.use_dot == (rows > 1)
        # A one-row program's weight tiles (two when gated) stay within the register budget.
        assert cfg.use_dot or cfg.block_n * cfg.block_k * (2 if gated else 1) <= GEMV_PRODUCT_ELEMENTS
        # Enough programs for every SM, unless the tiles are already as narrow as they go.
        narrowest = 16 if cfg.use_dot else GEMV_BLOCK_N[0]
        assert -(-n // cfg.block_n) >= sms * GEMV_PROGRAMS_PER_SM or cfg.block_n == narrowest


def test_rejects_bad_inputs(device):
    x, nw, w = torch.randn(2, 64, device=device), torch.randn(64, device=device), torch.randn(32, 64, device=device)
    out = torch.empty(2, 32, device=device)
    with pytest.raises(ValueError, match="must be \\[T, K\\] and \\[N, K\\]"):
        triton_rmsnorm_linear(x, nw, torch.randn(32, 48, device=device), out=out, eps=EPS)
    with pytest.raises(ValueError, match="norm_weight .* must be \\[64\\] torch.float32"):
        triton_rmsnorm_linear(x, nw.half(), w, out=out, eps=EPS)
    with pytest.raises(ValueError, match="bias .* must be \\[32\\]"):
        triton_rmsnorm_linear(x, nw, w, torch.randn(33, device=device), out=out, eps=EPS)
    with pytest.raises(ValueError, match="an even count"):
        triton_rmsnorm_linear_silu_mul(x, nw, w[:31], out=out[:, :15], eps=EPS)
    with pytest.raises(ValueError, match="out .* must be \\[2, 16\\]"):
        triton_rmsnorm_linear_silu_mul(x, nw, w, out=out, eps=EPS)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        triton_linear_residual(x, torch.randn(64, 32, device=device).t(), out, out=torch.empty_like(out))
    with pytest.raises(ValueError, match="residual .* must be \\[2, 32\\]"):
        triton_linear_residual(x, w, out[:1], out=out)


def test_registration_and_checker(device):
    bf16, attrs = DType.bf16, {"eps": EPS}
    x, nw, w = TensorType(("T", 576), bf16), TensorType((576,), bf16), TensorType((960, 576), bf16)
    y = TensorType(("T", 960), bf16)
    assert select_impl("rmsnorm_linear", [x, nw, w], attrs, "triton").name == "triton.rmsnorm_linear"
    bias = TensorType((960,), bf16)
    assert select_impl("rmsnorm_linear", [x, nw, w, bias], attrs, "triton").name == "triton.rmsnorm_linear"
    assert (select_impl("rmsnorm_linear_silu_mul", [x, nw, w], attrs, "triton").name
            == "triton.rmsnorm_linear_silu_mul")
    assert select_impl("linear_residual", [x, w, y], {}, "triton").name == "triton.linear_residual"
    # An f32 norm weight on bf16 activations goes to the reference, which rounds as the unfused graph.
    impl = select_impl("rmsnorm_linear", [x, nw.with_dtype(DType.f32), w], attrs, "triton")
    assert impl.name == "torch.rmsnorm_linear"
    xt = torch.randn(3, 576, device=device).bfloat16()
    nwt, wt = torch.randn(576, device=device), (torch.randn(960, 576, device=device) / 24).bfloat16()
    out = torch.empty(3, 960, device=device, dtype=torch.bfloat16)
    impl.fn(xt, nwt, wt, out=out, eps=EPS)
    _assert_close(out, ref_rmsnorm_linear(xt, nwt, wt, None, EPS))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 16])
@pytest.mark.parametrize("k,n", [(4096, 6144), (4096, 28672), (14336, 4096)])
def test_llama_shapes_on_gpu(tokens, k, n, device, poisoned, monkeypatch):
    import kiln.kernels.linear_fused as linear_fused

    for bound in ("GEMV_MAX_WEIGHT_BYTES", "GEMV_ONE_ROW_MAX_WEIGHT_BYTES"):  # the GEMV, whatever the engine's bound
        monkeypatch.setattr(linear_fused, bound, 1 << 62)
    dtype = torch.bfloat16
    x = torch.randn(tokens, k, device=device, dtype=dtype)
    norm_weight = torch.randn(k, device=device, dtype=dtype)
    weight = _weight(n, k, dtype, device)
    out = poisoned((tokens, n // 2), dtype)
    triton_rmsnorm_linear_silu_mul(x, norm_weight, weight, out=out, eps=EPS)
    _assert_close(out, ref_rmsnorm_linear_silu_mul(x, norm_weight, weight, EPS))
    residual = torch.randn(tokens, n, device=device, dtype=dtype)
    out = poisoned((tokens, n), dtype)
    triton_linear_residual(x, weight, residual, out=out)
    _assert_close(out, ref_linear_residual(x, weight, residual))
