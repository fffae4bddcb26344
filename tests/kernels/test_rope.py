"""Triton rope against its torch reference."""

from __future__ import annotations

import pytest
import torch

from kiln.ir.types import DType, TensorType
from kiln.kernels import select_impl
from kiln.kernels.rope import ref_rope, triton_rope

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _table(max_pos: int, rot: int, device: str) -> torch.Tensor:
    """A [max_pos, rot] cos|sin table, as the model's rope variant computes it."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    angles = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=1).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,head_dim,rot", [
    (1, 1, 64, 64), (5, 3, 64, 64), (7, 4, 128, 128),
    (3, 2, 80, 32),   # partial rotary: dims 32..80 pass through
    (4, 5, 96, 64),
])
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_rope_on_qkv_views(tokens, heads, head_dim, rot, pos_dtype, dtype, device, poisoned, assert_matches):
    # q is a view into a fused [T, (heads + 2) * head_dim] qkv output: token stride != heads * head_dim.
    qkv = torch.randn(tokens, heads + 2, head_dim, device=device).to(dtype) * 3
    x = qkv[:, :heads]
    table = _table(300, rot, device)
    positions = torch.randint(0, 300, (tokens,), device=device, dtype=pos_dtype)
    out = poisoned((tokens, heads, head_dim), dtype)
    triton_rope(x, positions, table, out=out)
    want = ref_rope(x, positions, table)
    if device == "cuda" and dtype != torch.float32:
        # Compiled, the kernel rounds each product to the dtype exactly where the reference does.
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    elif dtype == torch.bfloat16:
        # The interpreter truncates f32 -> bf16, so a product of magnitude ~|x| may be 1 ulp (2^-7
        # relative) off before the subtraction cancels most of it: the error is bounded by the
        # inputs' magnitude, not the result's. A wrong position or sign is off by O(|x|).
        assert not torch.isnan(out).any()
        bound = 2 * 2.0 ** -7 * x.float().abs().amax()
        assert (out.float() - want.float()).abs().max() <= bound
    else:
        assert_matches(out, want)


def test_rope_in_place(device, assert_matches):
    # Each program reads its elements before writing them, so out may alias x.
    x = torch.randn(6, 4, 64, device=device)
    positions = torch.arange(6, device=device)
    table = _table(16, 64, device)
    want = ref_rope(x, positions, table)
    triton_rope(x, positions, table, out=x)
    assert_matches(x, want)


def test_rejects_bad_inputs(device):
    x = torch.randn(3, 2, 64, device=device)
    table = _table(10, 64, device)
    pos = torch.arange(3, device=device)
    out = torch.empty_like(x)
    with pytest.raises(ValueError, match="cos_sin must be an f32"):
        triton_rope(x, pos, table.half(), out=out)
    with pytest.raises(ValueError, match="must be even and <= head_dim"):
        triton_rope(x, pos, _table(10, 128, device), out=out)
    with pytest.raises(ValueError, match="positions must be int32 or int64"):
        triton_rope(x, pos.float(), table, out=out)
    with pytest.raises(ValueError, match="positions .* do not match x"):
        triton_rope(x, torch.arange(4, device=device), table, out=out)
    with pytest.raises(ValueError, match="x must be \\[T, heads, head_dim\\]"):
        triton_rope(x[0], pos, table, out=out[0])
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        triton_rope(x.transpose(1, 2).contiguous().transpose(1, 2), pos, table, out=out)


def test_registration_and_checker():
    x = TensorType(("T", 32, 128), DType.bf16)
    pos = TensorType(("T",), DType.i32)
    table = TensorType((8192, 128), DType.f32)
    assert select_impl("rope", [x, pos, table], {}, "triton").name == "triton.rope"


@pytest.mark.gpu
def test_realistic_shape_on_gpu(device, poisoned, assert_matches):
    qkv = torch.randn(4096, 48, 128, device=device, dtype=torch.bfloat16)
    q = qkv[:, :32]
    positions = torch.randint(0, 8192, (4096,), device=device, dtype=torch.int32)
    table = _table(8192, 128, device)
    out = poisoned((4096, 32, 128), torch.bfloat16)
    triton_rope(q, positions, table, out=out)
    # Compiled, the kernel rounds exactly where the reference does: the results are bit-identical.
    torch.testing.assert_close(out, ref_rope(q, positions, table), rtol=0, atol=0)
