"""Triton silu_mul and add against their torch references."""

from __future__ import annotations

import pytest
import torch

from kiln.ir.types import DType, TensorType
from kiln.kernels import select_impl
from kiln.kernels.elementwise import ref_add, ref_silu_mul, triton_add, triton_silu_mul

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,width", [(1, 72), (7, 72), (3, 1100), (2, 4096)])
def test_silu_mul_on_split_views(tokens, width, dtype, device, poisoned, assert_matches):
    # gate and up are the two halves of one [T, 2I] GEMM output: column views with row stride 2I.
    fused = (torch.randn(tokens, 2 * width, device=device) * 4).to(dtype)
    gate, up = torch.split(fused, [width, width], dim=-1)
    out = poisoned((tokens, width), dtype)
    triton_silu_mul(gate, up, out=out)
    assert_matches(out, ref_silu_mul(gate, up))


def test_silu_mul_on_contiguous_inputs(device, poisoned, assert_matches):
    gate = torch.randn(5, 200, device=device)
    up = torch.randn(5, 200, device=device)
    out = poisoned((5, 200), torch.float32)
    triton_silu_mul(gate, up, out=out)
    assert_matches(out, ref_silu_mul(gate, up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,width", [(1, 2048), (5, 72), (3, 1100)])
def test_add(tokens, width, dtype, device, poisoned, assert_matches):
    a = torch.randn(tokens, 2 * width, device=device).to(dtype)[:, :width]  # a row stride of its own
    b = torch.randn(tokens, width, device=device).to(dtype)
    out = poisoned((tokens, width), dtype)
    triton_add(a, b, out=out)
    assert_matches(out, ref_add(a, b))
    triton_add(b, a, out=b)  # in place, as a memory plan may place it
    assert_matches(b, out)


def test_rejects_bad_inputs(device):
    gate = torch.randn(4, 64, device=device)
    out = torch.empty_like(gate)
    with pytest.raises(ValueError, match="up .* must match gate"):
        triton_silu_mul(gate, torch.randn(4, 32, device=device), out=out)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        triton_silu_mul(gate, torch.randn(64, 4, device=device).t(), out=out)
    with pytest.raises(ValueError, match="must be \\[T, I\\]"):
        triton_silu_mul(gate[0], gate[1], out=out[0])
    with pytest.raises(ValueError, match="must be f32, f16 or bf16"):
        triton_silu_mul(gate.int(), gate.int(), out=out.int())


def test_registration_and_checker():
    t = TensorType(("T", 14336), DType.bf16)
    assert select_impl("silu_mul", [t, t], {}, "triton").name == "triton.silu_mul"
    t3 = TensorType(("T", 2, 64), DType.bf16)
    assert select_impl("silu_mul", [t3, t3], {}, "triton").name == "torch.silu_mul"
    assert select_impl("add", [t, t], {}, "triton").name == "triton.add"
    # Broadcast or mixed-dtype adds stay on torch.
    assert select_impl("add", [t, TensorType((1, 14336), DType.bf16)], {}, "triton").name == "torch.add"
    assert select_impl("add", [t, TensorType(("T", 14336), DType.f32)], {}, "triton").name == "torch.add"


@pytest.mark.gpu
def test_realistic_shape_on_gpu(device, poisoned, assert_matches):
    fused = torch.randn(4096, 2 * 14336, device=device, dtype=torch.bfloat16)
    gate, up = torch.split(fused, [14336, 14336], dim=-1)
    out = poisoned((4096, 14336), torch.bfloat16)
    triton_silu_mul(gate, up, out=out)
    assert_matches(out, ref_silu_mul(gate, up))
