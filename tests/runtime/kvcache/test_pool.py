"""KVPool: per-layer views alias the one pool tensor; sizing math in tokens, bytes and memory fractions."""

from __future__ import annotations

import pytest
import torch

from kiln.runtime.kvcache import (KVPool, bytes_per_page, kv_budget_bytes, pages_for_budget, pages_for_mem_fraction,
                                  pages_for_tokens)


def small_pool(**overrides: object) -> KVPool:
    args = dict(num_layers=3, kv_heads=2, head_dim=8, dtype=torch.float16, device="cpu", num_pages=5, page_size=4)
    args.update(overrides)
    return KVPool(**args)  # type: ignore[arg-type]


def test_pool_shape_and_layer_views() -> None:
    pool = small_pool()
    assert pool.buffer.shape == (3, 2, 20, 2, 8) and pool.num_slots == 20
    views = pool.layer_views()
    assert list(views) == ["k_cache.0", "v_cache.0", "k_cache.1", "v_cache.1", "k_cache.2", "v_cache.2"]
    for view in views.values():
        assert view.shape == (20, 2, 8) and view.dtype == torch.float16 and view.is_contiguous()
    assert torch.count_nonzero(pool.buffer) == 0


def test_views_alias_the_pool_tensor() -> None:
    pool = small_pool()
    views = pool.layer_views()
    page, offset = 3, 1
    slot = page * pool.page_size + offset
    views["v_cache.1"][slot] = 7.0
    assert torch.all(pool.buffer[1, 1, slot] == 7.0)
    assert torch.all(pool.v(1)[slot] == 7.0)
    assert torch.count_nonzero(pool.buffer) == 2 * 8  # nothing else was written
    pool.buffer[2, 0, 5] = 1.5
    assert torch.all(pool.k(2)[5] == 1.5)
    storage = pool.buffer.untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == storage for v in views.values())


def test_pool_bytes_match_page_math() -> None:
    pool = small_pool(dtype=torch.bfloat16)
    per_page = bytes_per_page(3, 2, 8, torch.bfloat16, 4)
    assert per_page == 3 * 2 * 4 * 2 * 8 * 2
    assert pool.nbytes == 5 * per_page


def test_pages_for_tokens_rounds_up_and_adds_the_reserved_page() -> None:
    assert pages_for_tokens(16, 16) == 2
    assert pages_for_tokens(17, 16) == 3
    assert pages_for_tokens(1, 1) == 2
    with pytest.raises(ValueError):
        pages_for_tokens(0, 16)


def test_pages_for_budget() -> None:
    per_page = bytes_per_page(30, 3, 64, torch.bfloat16, 16)
    assert pages_for_budget(10 * per_page, 30, 3, 64, torch.bfloat16, 16) == 10
    assert pages_for_budget(10 * per_page - 1, 30, 3, 64, torch.bfloat16, 16) == 9
    assert pages_for_budget(-5, 30, 3, 64, torch.bfloat16, 16) == 0
    pool = KVPool(30, 3, 64, torch.bfloat16, "cpu", pages_for_budget(4 * per_page, 30, 3, 64, torch.bfloat16, 16), 16)
    assert pool.nbytes <= 4 * per_page


def test_kv_budget_follows_mem_fraction_static() -> None:
    gib = 1 << 30
    # 80 GiB device, weights took 16 GiB: 64 GiB free; 0.9 leaves 8 GiB for everything else.
    assert kv_budget_bytes(0.9, 64 * gib, 80 * gib) == 56 * gib
    # The same before the weights are loaded: 80 GiB free, 16 GiB of them to come.
    assert kv_budget_bytes(0.9, 80 * gib, 80 * gib, weight_bytes=16 * gib) == 56 * gib
    assert kv_budget_bytes(0.1, 64 * gib, 80 * gib) < 0
    with pytest.raises(ValueError):
        kv_budget_bytes(1.5, 64 * gib, 80 * gib)


def test_mem_fraction_needs_a_cuda_device() -> None:
    with pytest.raises(ValueError, match="explicit token count"):
        pages_for_mem_fraction(0.9, "cpu", 30, 3, 64, torch.bfloat16, 16, weight_bytes=0)


def test_pool_needs_a_usable_page() -> None:
    with pytest.raises(ValueError):
        small_pool(num_pages=1)
