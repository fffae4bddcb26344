"""``gemv_mma``'s transposed tensor-core GEMV (through the registry's quantized linear ops, with
``mma_gemv_max_rows`` and ``mma_weight_only_max_rows`` set) against the ``torch.<op>.<scheme>``
references, under the interpreter on the CPU (products in f32) and on the GPU; and its tiles."""

from __future__ import annotations

import pytest
import torch

from kiln.ir.weights import SCHEMES
from kiln.kernels import KernelConfig
from kiln.kernels.gemv_mma import MMA_ROWS, mma_gemv_tiles
from kiln.kernels.quantize import quantize
from kiln.kernels.triton_support import sm_count

from .conftest import DEVICE
from .test_linear_quantized_triton import OPS, _assert_matches, _operands, _run

CASES = [("int8_channel", "int8_per_token"), ("fp8_channel", "fp8_per_token"), ("int8_channel", None),
         ("mxfp4", None)]
MMA = KernelConfig(mma_gemv_max_rows=16, mma_weight_only_max_rows=16)


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("scheme,act_quant", CASES)
@pytest.mark.parametrize("op", OPS)
def test_mma_gemv_matches_reference(op, scheme, act_quant, rows):
    # 37 columns: one 64-row tile, most of it past N; K 200 (MXFP4 96): one partial K step; rows
    # padded to 16.
    args, scales = _operands(op, scheme, rows, 37, torch.float32, has_bias=rows != 3)
    _assert_matches(op, scheme, act_quant, args, scales, MMA)


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("scheme,act_quant", CASES)
def test_mma_gemv_in_bf16(scheme, act_quant, rows):
    args, scales = _operands("silu_mul_linear_residual", scheme, rows, 24, torch.bfloat16)
    _assert_matches("silu_mul_linear_residual", scheme, act_quant, args, scales, MMA)


@pytest.mark.parametrize("scheme,act_quant", CASES)
def test_mma_gemv_steps_through_k_and_column_tiles(scheme, act_quant):
    # 130 columns: three 64-row tiles, the last of 2; K 608 (19 MX blocks) in steps of 256, the last partial.
    k, n = 608, 130
    stored, scales = quantize(torch.randn(n, k) * k ** -0.5, SCHEMES[scheme])
    args = (torch.randn(2, k, device=DEVICE), stored.to(DEVICE), None)
    _assert_matches("linear", scheme, act_quant, args, tuple(s.to(DEVICE) for s in scales), MMA)


def test_rows_above_the_bound_take_the_other_gemvs():
    # 20 rows past mma_gemv_max_rows=16: the tl.dot GEMV runs (same result either way).
    args, scales = _operands("linear", "fp8_channel", 20, 37, torch.float32)
    _assert_matches("linear", "fp8_channel", "fp8_per_token", args, scales, MMA)


@pytest.mark.parametrize("scheme,act_quant", CASES)
def test_split_k_partials_add_up_in_split_order(scheme, act_quant):
    # K 608 in three steps of 256 split three ways (one program a K step for 3 column tiles, asked for
    # 4 programs an SM); twice, bit for bit: the counters are back at 0 after a launch and the sum's
    # order does not depend on which split finished last.
    k, n = 608, 130
    stored, scales = quantize(torch.randn(n, k) * k ** -0.5, SCHEMES[scheme])
    scales = tuple(s.to(DEVICE) for s in scales)
    args = (torch.randn(3, k, device=DEVICE), stored.to(DEVICE), torch.randn(n, device=DEVICE))
    split = KernelConfig(mma_gemv_max_rows=16, mma_weight_only_max_rows=16, mma_gemv_programs_per_sm=64)
    assert mma_gemv_tiles(3, n, k, sm_count(args[0]), SCHEMES[scheme].pack, split)[3] == 3
    _assert_matches("linear", scheme, act_quant, args, scales, split)
    assert torch.equal(_run("linear", scheme, act_quant, args, scales, "triton", split),
                       _run("linear", scheme, act_quant, args, scales, "triton", split))


def test_tiles():
    # Llama-3-8B's o projection on 132 SMs: 64 tiles of 64 rows, K split in 3 (192 programs).
    assert mma_gemv_tiles(1, 4096, 4096, 132) == (MMA_ROWS, 16, 256, 3)
    # gate/up: 448 tiles, no split; 20 rows pad to 32.
    assert mma_gemv_tiles(20, 28672, 4096, 132) == (MMA_ROWS, 32, 256, 1)
    # K of one step: nothing to split.
    assert mma_gemv_tiles(1, 64, 40, 132, config=KernelConfig(mma_gemv_block_k=512)) == (MMA_ROWS, 16, 64, 1)
