"""Triton rmsnorm and add_rmsnorm against their torch references."""

from __future__ import annotations

import pytest
import torch

from kiln.ir.types import DType, TensorType
from kiln.kernels import select_impl
from kiln.kernels.norm import MAX_HIDDEN, ref_add_rmsnorm, ref_rmsnorm, triton_add_rmsnorm, triton_rmsnorm

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# [T, hidden] activations and [T, heads, head_dim] q/k-norm inputs, odd sizes included.
SHAPES = [(1, 72), (7, 72), (3, 1000), (2, 4096), (5, 3, 64), (2, 4, 128)]


def _view(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """A tensor of ``shape`` that is a strided view into a wider one, as the q/k slices of a fused
    qkv output are: the last dim is contiguous, the others are not."""
    wide = torch.randn(*shape[:-1], 3 * shape[-1], device=device).to(dtype)
    return wide[..., shape[-1]:2 * shape[-1]] if len(shape) == 2 else wide.view(*shape[:-1], 3, shape[-1])[..., 1, :]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rmsnorm_matches_reference(shape, dtype, device, poisoned, assert_matches):
    x = _view(shape, dtype, device) * 3
    weight = torch.randn(shape[-1], device=device).to(dtype)
    out = poisoned(shape, dtype)
    triton_rmsnorm(x, weight, out=out, eps=1e-6)
    assert_matches(out, ref_rmsnorm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_add_rmsnorm_matches_reference(shape, dtype, device, poisoned, assert_matches):
    x = _view(shape, dtype, device)
    residual = torch.randn(shape, device=device).to(dtype) * 4
    weight = torch.randn(shape[-1], device=device).to(dtype)
    normed, summed = poisoned(shape, dtype), poisoned(shape, dtype)
    triton_add_rmsnorm(x, residual, weight, out=(normed, summed), eps=1e-5)
    want_normed, want_summed = ref_add_rmsnorm(x, residual, weight, 1e-5)
    assert_matches(summed, want_summed)
    assert_matches(normed, want_normed)


def test_f32_weight_on_bf16_activations(device, poisoned, assert_matches):
    # The reference promotes to f32 and the result is rounded once into the bf16 output.
    x = torch.randn(3, 72, device=device).to(torch.bfloat16)
    weight = torch.randn(72, device=device)
    out = poisoned((3, 72), torch.bfloat16)
    triton_rmsnorm(x, weight, out=out, eps=1e-6)
    assert_matches(out, ref_rmsnorm(x, weight, 1e-6))


def test_rejects_bad_inputs(device):
    x = torch.randn(4, 64, device=device)
    w = torch.randn(64, device=device)
    out = torch.empty_like(x)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        triton_rmsnorm(x, torch.randn(65, device=device), out=out, eps=1e-6)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        triton_rmsnorm(torch.randn(64, 4, device=device).t(), w, out=out, eps=1e-6)
    with pytest.raises(ValueError, match="must be f32, f16 or bf16"):
        triton_rmsnorm(x.to(torch.int32), w, out=out.to(torch.int32), eps=1e-6)
    with pytest.raises(ValueError, match="out .* must match x"):
        triton_rmsnorm(x, w, out=out.to(torch.float16), eps=1e-6)
    with pytest.raises(ValueError, match="must be \\[T, hidden\\]"):
        triton_rmsnorm(x[0], w, out=out[0], eps=1e-6)
    with pytest.raises(ValueError, match="residual .* must match x"):
        triton_add_rmsnorm(x, torch.randn(4, 32, device=device), w, out=(out, torch.empty_like(x)), eps=1e-6)


def test_registration_and_checker():
    eps = {"eps": 1e-6}
    bf16 = DType.bf16
    act, weight = TensorType(("T", 4096), bf16), TensorType((4096,), bf16)
    assert select_impl("rmsnorm", [act, weight], eps, "triton").name == "triton.rmsnorm"
    qk = TensorType(("T", 32, 128), bf16)
    assert select_impl("rmsnorm", [qk, TensorType((128,), bf16)], eps, "triton").name == "triton.rmsnorm"
    assert select_impl("add_rmsnorm", [act, act, weight], eps, "triton").name == "triton.add_rmsnorm"
    # Rows too wide for one program, and rank 1, go to the torch reference.
    wide = MAX_HIDDEN * 2
    assert select_impl("rmsnorm", [TensorType(("T", wide), bf16), TensorType((wide,), bf16)], eps,
                       "triton").name == "torch.rmsnorm"
    assert select_impl("rmsnorm", [TensorType((4096,), bf16), weight], eps, "triton").name == "torch.rmsnorm"


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4096), (64, 4096), (4096, 32, 128)])
def test_realistic_shapes_on_gpu(shape, device, poisoned, assert_matches):
    x = torch.randn(shape, device=device, dtype=torch.bfloat16)
    residual = torch.randn(shape, device=device, dtype=torch.bfloat16)
    weight = torch.randn(shape[-1], device=device, dtype=torch.bfloat16)
    normed, summed = poisoned(shape, torch.bfloat16), poisoned(shape, torch.bfloat16)
    triton_add_rmsnorm(x, residual, weight, out=(normed, summed), eps=1e-5)
    want_normed, want_summed = ref_add_rmsnorm(x, residual, weight, 1e-5)
    assert_matches(summed, want_summed)
    assert_matches(normed, want_normed)
