"""The per-token activation quantizer against ``quantize.quantize_rows``: the rounding bit for bit
(ties, saturation, e4m3 subnormals and binade carries), and whole rows with each prologue, from one
tile held in registers and from several passes, in f32 and bf16, at odd widths."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kiln.kernels import KernelConfig
from kiln.kernels.act_quant_triton import ACT_FP8, ACT_INT8, HARDWARE_FP8, quantize_act, quantize_rows
from kiln.kernels.norm import ref_rmsnorm
from kiln.kernels.quantize import quantize_rows as ref_quantize_rows

from .conftest import DEVICE

EPS = 1e-5


@triton.jit
def _quantize_act_kernel(x_ptr, int8_ptr, fp8_ptr, N: tl.constexpr, HARDWARE: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    tl.store(int8_ptr + offs, quantize_act(x, ACT_INT8, HARDWARE))
    tl.store(fp8_ptr + offs, quantize_act(x, ACT_FP8, HARDWARE))


def test_activation_rounding_is_torchs():
    # Ties (to even), a value just below a half, saturation, e4m3 subnormals and binade carries
    # (31.6 rounds up to 32): bit for bit torch's round() and float8_e4m3fn cast.
    edges = [0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997, 126.5, -126.5, 300.0, -500.0, 1e-3, 0.0, 17.0, 100.0, 200.0,
             31.6013, 2.0 ** -10, 3 * 2.0 ** -10, -(2.0 ** -7) * 1.0625]
    x = torch.cat([torch.randn(1024 - len(edges)) * 60, torch.tensor(edges)]).to(DEVICE)
    as_int8, as_fp8 = torch.empty_like(x), torch.empty_like(x)
    _quantize_act_kernel[(1,)](x, as_int8, as_fp8, N=1024, HARDWARE=HARDWARE_FP8)
    assert torch.equal(as_int8, x.clamp(-127, 127).round())
    assert torch.equal(as_fp8, x.clamp(-448, 448).to(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("one_tile", [True, False])
@pytest.mark.parametrize("act_quant", ["int8_per_token", "fp8_per_token"])
@pytest.mark.parametrize("prologue", ["raw", "norm", "silu_mul"])
def test_quantize_rows_kernel_matches_reference(prologue, act_quant, one_tile, dtype):
    k = 200
    x = torch.randn(7, 2 * k if prologue == "silu_mul" else k, device=DEVICE).to(dtype)
    x[3] = 0  # an all-zero row gets scale 1
    norm_weight = torch.randn(k, device=DEVICE).to(dtype) if prologue == "norm" else None
    config = KernelConfig(act_quant_block_k=256 if one_tile else 64)
    q, scale = quantize_rows(x, act_quant, norm_weight=norm_weight, gated=prologue == "silu_mul", eps=EPS,
                             config=config)
    if prologue == "norm":
        gemm_input = ref_rmsnorm(x, norm_weight, EPS)
    elif prologue == "silu_mul":  # rounded as the unfused graph's silu_mul kernel rounds
        gate = x[:, :k].float()
        gemm_input = ((gate * torch.sigmoid(gate)).to(dtype).float() * x[:, k:].float()).to(dtype)
    else:
        gemm_input = x
    assert scale[3].item() == 1.0
    expected = ref_quantize_rows(gemm_input, act_quant)
    if dtype == torch.float32:
        torch.testing.assert_close(q.float() * scale, expected, rtol=1e-5, atol=1e-5)
    else:  # the interpreter truncates bf16 where torch rounds, twice in the norm: an input 2-3 ulps (up
        # to 2%) off, and the row's scale with it; each value within a step and that much of the reference
        step = 0.13 * expected.abs() + scale * 2 ** -9 if act_quant == "fp8_per_token" else scale
        assert ((q.float() * scale - expected).abs() <= step + 0.03 * expected.abs()).all()
