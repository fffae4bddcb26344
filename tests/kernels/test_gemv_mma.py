"""``gemv_mma``'s transposed tensor-core GEMV against the references, under the interpreter on the CPU
(products in f32) and on a Hopper GPU: W8A8 through the registry's quantized linear ops (against
``torch.<op>.<scheme>``); and its tiles."""

from __future__ import annotations

import pytest
import torch

from kiln.ir.weights import SCHEMES
from kiln.kernels import KernelConfig
from kiln.kernels.gemv_mma import MMA_ROWS, mma_gemv_tiles
from kiln.kernels.quantize import quantize

from .conftest import DEVICE
from .test_linear_quantized_triton import OPS, _assert_matches, _operands, _tolerance

W8A8 = [("int8_channel", "int8_per_token"), ("fp8_channel", "fp8_per_token")]
MMA = KernelConfig(mma_gemv_max_rows=16)
# Both ways x reaches the GEMV: quantized by its own launch, or by every program (mma_gemv_quantizes).
CONFIGS = [MMA, KernelConfig(mma_gemv_max_rows=16, mma_gemv_quantizes=True)]
# On the GPU, f32 outputs of fp8 products: Hopper's fp8 MMA sums each 128 values of K with fewer bits
# than f32 before they reach the f32 accumulator (~1e-3 of unit outputs; int8's sums are exact).
FP8_MMA_F32 = dict(rtol=2e-3, atol=2e-3)


def _matches(op, scheme, act_quant, args, scales, config=MMA):
    tolerance = FP8_MMA_F32 if DEVICE == "cuda" and act_quant == "fp8_per_token" and \
        args[0].dtype == torch.float32 else None
    _assert_matches(op, scheme, act_quant, args, scales, config, tolerance)


@pytest.mark.parametrize("config", CONFIGS, ids=["quantized-before", "quantized-in-gemv"])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("scheme,act_quant", W8A8)
@pytest.mark.parametrize("op", OPS)
def test_mma_gemv_matches_reference(op, scheme, act_quant, rows, config):
    # 37 columns: one 64-row tile, most of it past N; K 200: one partial K step; rows padded to 16.
    args, scales = _operands(op, scheme, rows, 37, torch.float32, has_bias=rows != 3)
    _matches(op, scheme, act_quant, args, scales, config)


@pytest.mark.parametrize("config", CONFIGS, ids=["quantized-before", "quantized-in-gemv"])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("scheme,act_quant", W8A8)
@pytest.mark.parametrize("op", ["rmsnorm_linear", "silu_mul_linear_residual"])
def test_mma_gemv_in_bf16(op, scheme, act_quant, rows, config):
    args, scales = _operands(op, scheme, rows, 24, torch.bfloat16)
    _matches(op, scheme, act_quant, args, scales, config)


@pytest.mark.parametrize("quantizes", [False, True])
@pytest.mark.parametrize("scheme,act_quant", W8A8)
def test_mma_gemv_steps_through_k_and_column_tiles(scheme, act_quant, quantizes):
    # 130 columns: three 64-row tiles, the last of 2; K 600 in steps of 256, the last partial; the
    # in-GEMV quantizer's passes over x in 64-value steps (gemv_norm_pass_elements / 16 rows).
    k, n = 600, 130
    stored, scales = quantize(torch.randn(n, k) * k ** -0.5, SCHEMES[scheme])
    args = (torch.randn(2, k, device=DEVICE), torch.randn(k, device=DEVICE), stored.to(DEVICE), None)
    _matches("rmsnorm_linear", scheme, act_quant, args, tuple(s.to(DEVICE) for s in scales),
             KernelConfig(mma_gemv_max_rows=16, mma_gemv_block_k=256, mma_gemv_quantizes=quantizes,
                          gemv_norm_pass_elements=1024))


def test_rows_above_the_bound_take_the_other_gemvs():
    # 20 rows past mma_gemv_max_rows=16: the tl.dot GEMV runs (same result either way).
    args, scales = _operands("linear", "fp8_channel", 20, 37, torch.float32)
    _matches("linear", "fp8_channel", "fp8_per_token", args, scales)


@pytest.mark.gpu
@pytest.mark.parametrize("quantizes", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("scheme,act_quant", W8A8)
def test_mma_gemv_at_llama_shapes_on_gpu(scheme, act_quant, rows, quantizes):
    # Llama-3-8B's down projection (K 14336) in bf16, as decode runs it on Hopper (the default bound).
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("gemv_mma runs on Hopper (wgmma)")
    n, k = 512, 14336
    stored, scales = quantize(torch.randn(n, k) * k ** -0.5, SCHEMES[scheme])
    x, residual = torch.randn(rows, k, device="cuda").bfloat16(), torch.randn(rows, n, device="cuda").bfloat16()
    _assert_matches("linear_residual", scheme, act_quant, (x, stored.cuda(), residual),
                    tuple(s.cuda() for s in scales), KernelConfig(mma_gemv_quantizes=quantizes),
                    _tolerance(torch.bfloat16, act_quant))


def test_tiles():
    # One row: K steps of 512, (64 + 16) x 512 x 4 stages = 160 KB of shared memory.
    assert mma_gemv_tiles(1, 4096) == (MMA_ROWS, 16, 512)
    # 64 rows: 512 would take 256 KB, so 256.
    assert mma_gemv_tiles(64, 4096) == (MMA_ROWS, 64, 256)
    # 20 rows pad to 32; a short K takes one step.
    assert mma_gemv_tiles(20, 40) == (MMA_ROWS, 32, 64)
    # A program quantizing its own bf16 rows keeps their tiles and their 8-bit copy: (64 + 16 x 3) x 512
    # x 4 = 224 KB, so 256 at one row (232 KB asked for at 512 did not launch on an H100).
    assert mma_gemv_tiles(1, 4096, input_bytes=2) == (MMA_ROWS, 16, 256)
