"""Triton rmsnorm_linear, linear_residual, silu_mul_linear_residual and plain linear against their torch
references, on the fused GEMV (T <= GEMV_MAX_ROWS) and on the composed path (more rows)."""

from __future__ import annotations

import pytest
import torch

from kiln.ir.types import DType, TensorType
from kiln.kernels import KernelConfig, get_impl, select_impl
from kiln.kernels.config import DEFAULTS
from kiln.kernels.gemv import GEMV_MAX_ROWS, gemv_config
from kiln.kernels.linear import ref_linear
from kiln.kernels.linear_fused import (ref_linear_residual, ref_rmsnorm_linear, ref_silu_mul_linear_residual,
                                       triton_linear, triton_linear_residual, triton_rmsnorm_linear,
                                       triton_silu_mul_linear_residual, uses_gemv)

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
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("tokens,k,n", CASES + [(1, 2048, 128), (3, 64, 1)])
def test_linear(tokens, k, n, has_bias, dtype, device, poisoned):
    """Plain linear (an MoE router: 128 experts; a shared expert's one-column gate)."""
    x = _strided(tokens, k, dtype, device)
    weight = _weight(n, k, dtype, device)
    bias = torch.randn(n, device=device).to(dtype) if has_bias else None
    out = poisoned((tokens, n), dtype)
    triton_linear(x, weight, bias, out=out)
    _assert_close(out, ref_linear(x, weight, bias))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,k,n", CASES)
def test_linear_residual(tokens, k, n, dtype, device, poisoned):
    x = _strided(tokens, k, dtype, device)
    weight = _weight(n, k, dtype, device)
    residual = _strided(tokens, n, dtype, device, scale=2.0)
    out = poisoned((tokens, n), dtype)
    triton_linear_residual(x, weight, residual, out=out)
    _assert_close(out, ref_linear_residual(x, weight, residual))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,k,n", CASES)
def test_silu_mul_linear_residual(tokens, k, n, dtype, device, poisoned):
    gate_up = _strided(tokens, 2 * k, dtype, device)
    weight = _weight(n, k, dtype, device)
    residual = _strided(tokens, n, dtype, device, scale=2.0)
    out = poisoned((tokens, n), dtype)
    triton_silu_mul_linear_residual(gate_up, weight, residual, out=out)
    _assert_close(out, ref_silu_mul_linear_residual(gate_up, weight, residual))


@pytest.mark.parametrize("op", ["linear_residual", "silu_mul_linear_residual"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("tokens,k,n", [(1, 3000, 40), (5, 576, 100), (40, 576, 960)])
def test_residual_ops_may_write_over_their_residual(tokens, k, n, op, backend, device):
    # The memory plan gives these ops' output the residual's storage where the residual is read last
    # (OpDef.reuses): every implementation must read each residual element before writing it.
    x = _strided(tokens, k * (2 if op.startswith("silu") else 1), torch.float32, device)
    weight = _weight(n, k, torch.float32, device)
    residual = torch.randn(tokens, n, device=device)
    ref = ref_silu_mul_linear_residual if op.startswith("silu") else ref_linear_residual
    expected = ref(x, weight, residual.clone())
    get_impl(f"{backend}.{op}").fn(x, weight, residual, out=residual)
    _assert_close(residual, expected)


@pytest.mark.parametrize("tokens", [1, 3])
def test_large_weights_take_the_composed_path(tokens, device, poisoned):
    x, norm_weight = torch.randn(tokens, 72, device=device), torch.randn(72, device=device)
    weight, residual = _weight(48, 72, torch.float32, device), torch.randn(tokens, 48, device=device)
    assert uses_gemv(x, weight)
    # One row has its own bound (the GEMV streams large weights well at one row, not at several).
    bound = "gemv_one_row_max_weight_bytes" if tokens == 1 else "gemv_max_weight_bytes"
    config = KernelConfig().with_settings({bound: weight.numel() * 4 - 1})
    assert not uses_gemv(x, weight, config)
    out = poisoned((tokens, 48), torch.float32)
    triton_rmsnorm_linear(x, norm_weight, weight, out=out, eps=EPS, config=config)
    _assert_close(out, ref_rmsnorm_linear(x, norm_weight, weight, None, EPS))
    triton_linear_residual(x, weight, residual, out=out, config=config)
    _assert_close(out, ref_linear_residual(x, weight, residual))
    gate_up = torch.randn(tokens, 144, device=device)
    triton_silu_mul_linear_residual(gate_up, weight, residual, out=out, config=config)
    _assert_close(out, ref_silu_mul_linear_residual(gate_up, weight, residual))


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096),
                                 (960, 576), (576, 576), (1536, 576), (576, 1536), (49152, 576)])
@pytest.mark.parametrize("config", [DEFAULTS, KernelConfig(gemv_block_n=(4, 4), gemv_block_k=(64, 2048)),
                                    KernelConfig(gemv_product_elements=8192, gemv_programs_per_sm=4)])
def test_gemv_tiles_fill_an_h200(n, k, config):
    sms = 132
    for rows in range(1, GEMV_MAX_ROWS + 1):
        cfg = gemv_config(rows, n, k, sms, config)
        assert cfg.block_t >= rows and cfg.block_n >= min(rows, 16) and cfg.block_k >= config.gemv_block_k[0]
        assert cfg.use_dot == (rows > 1)
        # A one-row program's weight tile stays within the register budget.
        assert cfg.use_dot or cfg.block_n * cfg.block_k <= config.gemv_product_elements
        # Enough programs for every SM, unless the tiles are already as narrow as they go.
        narrowest = 16 if cfg.use_dot else config.gemv_block_n[0]
        assert -(-n // cfg.block_n) >= sms * config.gemv_programs_per_sm or cfg.block_n == narrowest


def test_rejects_bad_inputs(device):
    x, nw, w = torch.randn(2, 64, device=device), torch.randn(64, device=device), torch.randn(32, 64, device=device)
    out = torch.empty(2, 32, device=device)
    with pytest.raises(ValueError, match="must be \\[T, K\\] and \\[N, K\\]"):
        triton_rmsnorm_linear(x, nw, torch.randn(32, 48, device=device), out=out, eps=EPS)
    with pytest.raises(ValueError, match="norm_weight .* must be \\[64\\] torch.float32"):
        triton_rmsnorm_linear(x, nw.half(), w, out=out, eps=EPS)
    with pytest.raises(ValueError, match="bias .* must be \\[32\\]"):
        triton_rmsnorm_linear(x, nw, w, torch.randn(33, device=device), out=out, eps=EPS)
    with pytest.raises(ValueError, match="gate_up \\(2, 64\\) and weight .* must be \\[T, 2K\\] and \\[N, K\\]"):
        triton_silu_mul_linear_residual(x, w, out, out=out)
    with pytest.raises(ValueError, match="out .* must be \\[2, 32\\]"):
        triton_silu_mul_linear_residual(x, w[:, :32], out, out=out[:, :16])
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
    assert select_impl("linear_residual", [x, w, y], {}, "triton").name == "triton.linear_residual"
    assert select_impl("linear", [x, w], {}, "triton").name == "triton.linear"
    gate_up, down = TensorType(("T", 1920), bf16), TensorType((576, 960), bf16)
    assert (select_impl("silu_mul_linear_residual", [gate_up, down, x], {}, "triton").name
            == "triton.silu_mul_linear_residual")
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
def test_llama_shapes_on_gpu(tokens, k, n, device, poisoned):
    # The GEMV, whatever the engine's bound.
    config = KernelConfig(gemv_max_weight_bytes=1 << 62, gemv_one_row_max_weight_bytes=1 << 62)
    dtype = torch.bfloat16
    x = torch.randn(tokens, k, device=device, dtype=dtype)
    norm_weight = torch.randn(k, device=device, dtype=dtype)
    weight = _weight(n, k, dtype, device)
    out = poisoned((tokens, n), dtype)
    triton_rmsnorm_linear(x, norm_weight, weight, out=out, eps=EPS, config=config)
    _assert_close(out, ref_rmsnorm_linear(x, norm_weight, weight, None, EPS))
    residual = torch.randn(tokens, n, device=device, dtype=dtype)
    triton_linear_residual(x, weight, residual, out=out, config=config)
    _assert_close(out, ref_linear_residual(x, weight, residual))
    gate_up = torch.randn(tokens, 2 * k, device=device, dtype=dtype)
    triton_silu_mul_linear_residual(gate_up, weight, residual, out=out, config=config)
    _assert_close(out, ref_silu_mul_linear_residual(gate_up, weight, residual))
