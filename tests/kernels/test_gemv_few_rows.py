"""The few-row GEMV (``gemv_few_rows.py``) through ``linear_fused``'s Triton ops, with
``gemv_few_rows_max`` on: every row count it takes (2-8), K in one masked step and in several, N
below and above one program's columns, against the torch references."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels import KernelConfig
from kiln.kernels.config import KernelConfigError
from kiln.kernels.gemv_few_rows import few_rows_tiles
from kiln.kernels.linear import ref_linear
from kiln.kernels.linear_fused import (ref_linear_residual, ref_rmsnorm_linear, ref_silu_mul_linear_residual,
                                       triton_linear, triton_linear_residual, triton_rmsnorm_linear,
                                       triton_silu_mul_linear_residual, uses_gemv)

from .test_linear_fused import EPS, _assert_close, _strided, _weight

FEW_ROWS = KernelConfig(gemv_few_rows_max=8)
# (rows, K, N); one warp's K step is 256 values of f32 x (4 a thread) at the tests' config below.
CASES = [(2, 72, 24), (3, 1000, 40), (5, 3000, 24), (6, 200, 100), (8, 576, 100)]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k,n", CASES)
def test_rmsnorm_linear_with_bias(rows, k, n, dtype, device, poisoned):
    x = _strided(rows, k, dtype, device, scale=3.0)
    norm_weight = torch.randn(k, device=device).to(dtype)
    weight = _weight(n, k, dtype, device)
    bias = torch.randn(n, device=device).to(dtype)
    out = poisoned((rows, n), dtype)
    triton_rmsnorm_linear(x, norm_weight, weight, bias, out=out, eps=EPS, config=FEW_ROWS)
    _assert_close(out, ref_rmsnorm_linear(x, norm_weight, weight, bias, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k,n", CASES)
def test_linear_residual(rows, k, n, dtype, device, poisoned):
    x = _strided(rows, k, dtype, device)
    weight = _weight(n, k, dtype, device)
    residual = _strided(rows, n, dtype, device, scale=2.0)
    out = poisoned((rows, n), dtype)
    triton_linear_residual(x, weight, residual, out=out, config=FEW_ROWS)
    _assert_close(out, ref_linear_residual(x, weight, residual))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k,n", CASES)
def test_silu_mul_linear_residual(rows, k, n, dtype, device, poisoned):
    gate_up = _strided(rows, 2 * k, dtype, device)
    weight = _weight(n, k, dtype, device)
    residual = _strided(rows, n, dtype, device, scale=2.0)
    out = poisoned((rows, n), dtype)
    triton_silu_mul_linear_residual(gate_up, weight, residual, out=out, config=FEW_ROWS)
    _assert_close(out, ref_silu_mul_linear_residual(gate_up, weight, residual))


@pytest.mark.parametrize("rows,k,n", [(4, 3000, 40), (7, 64, 1)])
def test_linear_at_one_warp_steps_through_k(rows, k, n, device, poisoned):
    """One warp (K steps of 128 f32 values) and tiles of 4 columns: many steps and programs."""
    config = KernelConfig(gemv_few_rows_max=8, gemv_num_warps=1, gemv_block_n=(4, 4))
    assert few_rows_tiles(n, k, 1, 4, config)[:2] == (4, min(128, k))
    x = _strided(rows, k, torch.float32, device)
    weight = _weight(n, k, torch.float32, device)
    out = poisoned((rows, n), torch.float32)
    triton_linear(x, weight, out=out, config=config)
    _assert_close(out, ref_linear(x, weight))


def test_few_rows_take_weights_as_large_as_one_row():
    """With the few-row GEMV on, 2-8 rows stream weights up to the one-row bound (where the tl.dot
    GEMV hands large ones to cuBLAS); 9 rows still go by gemv_max_weight_bytes."""
    weight = torch.empty(4096, 4096, dtype=torch.bfloat16, device="meta")  # 32 MB
    for rows, expected in ((5, True), (8, True), (9, False)):
        x = torch.empty(rows, 4096, dtype=torch.bfloat16, device="meta")
        assert uses_gemv(x, weight, FEW_ROWS) is expected
        assert not uses_gemv(x, weight)


@pytest.mark.parametrize("value", [9, -1])
def test_few_rows_max_is_bounded(value):
    with pytest.raises(KernelConfigError, match="gemv_few_rows_max must be an int >= 0 and <= 8"):
        KernelConfig(gemv_few_rows_max=value)
