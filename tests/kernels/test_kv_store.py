"""Triton kv_store against its torch reference (a copy: results must be identical)."""

from __future__ import annotations

import pytest
import torch

from kiln.ir.types import DType, TensorType
from kiln.kernels import select_impl
from kiln.kernels.kv_store import ref_kv_store, triton_kv_store

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,kv_heads,head_dim,slots_count", [(1, 1, 64, 8), (7, 3, 64, 40), (5, 8, 128, 64),
                                                                  (4, 2, 72, 16)])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_kv_store_scatters_views(tokens, kv_heads, head_dim, slots_count, slot_dtype, dtype, device):
    # k and v are views into a fused qkv output; some tokens are padding (slot -1).
    qkv = torch.randn(tokens, 4 + 2 * kv_heads, head_dim, device=device).to(dtype)
    k, v = qkv[:, 4:4 + kv_heads], qkv[:, 4 + kv_heads:]
    slots = torch.randperm(slots_count, device=device)[:tokens].to(slot_dtype)
    slots[::3] = -1
    k_cache = torch.randn(slots_count, kv_heads, head_dim, device=device).to(dtype)
    v_cache = torch.randn_like(k_cache)
    want_k, want_v = ref_kv_store(k_cache.clone(), v_cache.clone(), k, v, slots)
    got_k, got_v = triton_kv_store(k_cache, v_cache, k, v, slots)
    assert got_k is k_cache and got_v is v_cache  # an in-place op: it returns the caches themselves
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_rejects_bad_inputs(device):
    cache = torch.zeros(8, 2, 64, device=device)
    k = torch.randn(3, 2, 64, device=device)
    slots = torch.arange(3, device=device)
    with pytest.raises(ValueError, match="caches must be contiguous"):
        triton_kv_store(torch.zeros(2, 8, 64, device=device).transpose(0, 1), cache, k, k, slots)
    with pytest.raises(ValueError, match="does not fit cache"):
        triton_kv_store(cache, cache.clone(), k.half(), k.half(), slots)
    with pytest.raises(ValueError, match="does not fit cache"):
        triton_kv_store(cache, cache.clone(), torch.randn(3, 1, 64, device=device), k, slots)
    with pytest.raises(ValueError, match="slots must be int32 or int64"):
        triton_kv_store(cache, cache.clone(), k, k, slots.float())
    with pytest.raises(ValueError, match="slots .* do not match k"):
        triton_kv_store(cache, cache.clone(), k, k, torch.arange(2, device=device))


def test_registration_and_checker():
    cache = TensorType(("NS", 8, 128), DType.bf16)
    new = TensorType(("T", 8, 128), DType.bf16)
    slots = TensorType(("T",), DType.i32)
    assert select_impl("kv_store", [cache, cache, new, new, slots], {}, "triton").name == "triton.kv_store"


@pytest.mark.gpu
def test_realistic_shape_on_gpu(device):
    qkv = torch.randn(4096, 48, 128, device=device, dtype=torch.bfloat16)
    k, v = qkv[:, 32:40], qkv[:, 40:]
    slots = torch.randperm(1 << 20, device=device)[:4096].int()
    k_cache = torch.zeros(1 << 20, 8, 128, device=device, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    want_k, want_v = ref_kv_store(k_cache.clone(), v_cache.clone(), k, v, slots)
    triton_kv_store(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
