"""RadixCache: page-aligned prefix matching, splitting, namespaces, locks, LRU eviction and page ownership."""

from __future__ import annotations

import pytest

from kiln.runtime.kvcache import PageAllocator, RadixCache

PAGE_SIZES = [1, 4, 16]


def make_cache(page_size: int, num_pages: int = 64) -> RadixCache:
    return RadixCache(PageAllocator(num_pages), page_size)


def seq(*page_tokens: int, page_size: int) -> list[int]:
    """One page per argument, each page filled with distinct ids derived from that argument."""
    return [t * 1000 + i for t in page_tokens for i in range(page_size)]


def cache_sequence(cache: RadixCache, namespace: object, tokens: list[int]) -> list[int]:
    """Allocate pages for the whole pages of ``tokens`` and insert them, as a finished request would."""
    pages = cache.allocator.alloc(len(tokens) // cache.page_size)
    assert pages is not None
    cache.insert(namespace, tokens, pages)
    return pages


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_shared_prefix_match_is_page_aligned(page_size: int) -> None:
    cache = make_cache(page_size)
    tokens = seq(1, 2, 3, page_size=page_size)
    pages = cache_sequence(cache, None, tokens)
    query = tokens[: 2 * page_size] + [99] * (page_size - 1)  # a partial third page never matches
    match = cache.match_prefix(None, query + [5])
    assert match.length == 2 * page_size and match.pages == pages[:2]
    full = cache.match_prefix(None, tokens + [7, 8])
    assert full.length == 3 * page_size and full.pages == pages
    assert cache.match_prefix(None, tokens[: page_size - 1]).length == 0
    cache.check_invariants()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_insert_ignores_tokens_beyond_the_given_pages(page_size: int) -> None:
    cache = make_cache(page_size)
    tokens = seq(1, 2, page_size=page_size) + [5] * (page_size - 1)
    pages = cache_sequence(cache, None, tokens)
    assert len(pages) == 2 and cache.cached_pages == 2
    assert cache.match_prefix(None, tokens + [6]).length == 2 * page_size
    with pytest.raises(ValueError):
        cache.insert(None, tokens[:page_size], cache.allocator.alloc(2))


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_match_inside_a_node_splits_it(page_size: int) -> None:
    cache = make_cache(page_size)
    pages = cache_sequence(cache, None, seq(1, 2, 3, 4, page_size=page_size))
    match = cache.match_prefix(None, seq(1, 2, 9, page_size=page_size))
    assert match.pages == pages[:2]
    assert len(match.node.key) == 2 * page_size and len(match.node.children) == 1
    cache.check_invariants()
    branch = cache_sequence(cache, None, seq(1, 2, 9, page_size=page_size))
    assert len(branch) == 3 and len(match.node.children) == 2
    assert all(cache.allocator.is_free(p) for p in branch[:2])  # they duplicated the cached 1-2
    cache.check_invariants()
    assert cache.match_prefix(None, seq(1, 2, 9, page_size=page_size)).pages == pages[:2] + branch[2:]
    assert cache.match_prefix(None, seq(1, 2, 3, 4, page_size=page_size)).pages == pages


def test_insert_branching_inside_a_node_splits_it() -> None:
    cache = make_cache(4)
    first = cache_sequence(cache, None, seq(1, 2, 3, page_size=4))
    second = cache_sequence(cache, None, seq(1, 2, 7, 8, page_size=4))
    assert cache.cached_pages == 5 and cache.allocator.is_free(second[0]) and cache.allocator.is_free(second[1])
    assert cache.match_prefix(None, seq(1, 2, 7, 8, page_size=4)).pages == first[:2] + second[2:]
    cache.check_invariants()


def test_namespaces_never_share_entries() -> None:
    cache = make_cache(4)
    tokens = seq(1, 2, page_size=4)
    base = cache_sequence(cache, None, tokens)
    assert cache.match_prefix(("lora", "a"), tokens).length == 0
    adapter = cache_sequence(cache, ("lora", "a"), tokens)
    assert set(base).isdisjoint(adapter) and cache.cached_pages == 4
    assert cache.match_prefix(("lora", "a"), tokens).pages == adapter
    assert cache.match_prefix(None, tokens).pages == base
    assert cache.match_prefix(("lora", "b"), tokens).pages == []
    cache.check_invariants()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_lock_prevents_eviction(page_size: int) -> None:
    cache = make_cache(page_size)
    tokens = seq(1, 2, 3, page_size=page_size)
    cache_sequence(cache, None, tokens)
    match = cache.match_prefix(None, tokens[: 2 * page_size])
    cache.lock(match.node)
    assert cache.evictable_pages == 1
    assert cache.evict(100) == 1  # only the unlocked third page can go
    assert cache.match_prefix(None, tokens).pages == match.pages
    cache.unlock(match.node)
    assert cache.evictable_pages == 2 and cache.evict(100) == 2
    assert cache.cached_pages == 0 and cache.allocator.free_count == cache.allocator.total
    assert cache.evicted_tokens == 3 * page_size
    cache.check_invariants()


def test_lock_handle_survives_a_split() -> None:
    cache = make_cache(4)
    tokens = seq(1, 2, 3, 4, page_size=4)
    cache_sequence(cache, None, tokens)
    held = cache.match_prefix(None, tokens)
    cache.lock(held.node)
    cache.match_prefix(None, tokens[:8])  # splits the locked node above it
    cache.check_invariants()
    assert cache.evict(100) == 0
    cache.unlock(held.node)
    assert cache.evictable_pages == 4 and cache.evict(100) == 4
    cache.check_invariants()


def test_lru_order_and_parents_become_candidates() -> None:
    cache = make_cache(2)
    a = cache_sequence(cache, None, seq(1, page_size=2))
    b = cache_sequence(cache, None, seq(2, page_size=2))
    shared = cache_sequence(cache, None, seq(3, 4, page_size=2))
    tail = cache_sequence(cache, None, seq(3, 4, 5, page_size=2))
    cache.match_prefix(None, seq(1, page_size=2))  # a is now the most recent
    order = []
    for _ in range(4):
        before = set(cache.allocator.free_pages())
        assert cache.evict(1) >= 1
        order.append(sorted(set(cache.allocator.free_pages()) - before))
    # b is oldest; then the tail leaf of 3-4-5, then its parent 3-4 (a leaf now), then a.
    assert order == [b, tail[2:], shared, a]
    cache.check_invariants()


def test_duplicate_insert_frees_the_duplicate_pages() -> None:
    cache = make_cache(4, num_pages=16)
    tokens = seq(1, 2, 3, page_size=4)
    original = cache_sequence(cache, None, tokens)
    duplicate = cache.allocator.alloc(3)
    free_before = cache.allocator.free_count
    assert cache.insert(None, tokens, duplicate) == 12
    assert cache.allocator.free_count == free_before + 3 and all(cache.allocator.is_free(p) for p in duplicate)
    assert cache.match_prefix(None, tokens).pages == original and cache.cached_pages == 3
    cache.check_invariants()


def test_insert_keeps_the_tree_pages_a_request_matched() -> None:
    cache = make_cache(4, num_pages=16)
    prompt = seq(1, 2, page_size=4)
    cache_sequence(cache, None, prompt)
    match = cache.match_prefix(None, prompt)
    cache.lock(match.node)
    own = cache.allocator.alloc(2)
    assert cache.insert(None, prompt + seq(5, 6, page_size=4), match.pages + own) == 8
    cache.unlock(match.node)
    assert cache.cached_pages == 4 and cache.allocator.free_count == 15 - 4
    cache.check_invariants()


def test_insert_running_swaps_duplicates_for_tree_pages() -> None:
    cache = make_cache(4, num_pages=16)
    prompt = seq(1, 2, 3, page_size=4)
    first_match, second_match = cache.match_prefix(None, prompt), cache.match_prefix(None, prompt)
    first, second = cache.allocator.alloc(3), cache.allocator.alloc(3)  # two requests prefill the same prompt
    first_now = cache.insert_running(None, prompt, first, first_match.node)
    assert first_now.pages == first and first_now.node.lock_count == 1
    second_now = cache.insert_running(None, prompt, second, second_match.node)
    assert second_now.pages == first and first_now.node.lock_count == 2
    assert all(cache.allocator.is_free(p) for p in second)
    assert cache.evict(100) == 0
    cache.check_invariants()
    cache.unlock(first_now.node)
    cache.unlock(second_now.node)
    assert cache.evict(100) == 3
    cache.check_invariants()


def test_reset_frees_everything_unlocked_and_drops_empty_namespaces() -> None:
    cache = make_cache(4)
    kept = cache_sequence(cache, "v1", seq(1, 2, page_size=4))
    cache_sequence(cache, "v1", seq(1, 3, page_size=4))
    cache_sequence(cache, "v2", seq(4, page_size=4))
    held = cache.match_prefix("v1", seq(1, 2, page_size=4))
    cache.lock(held.node)
    assert cache.reset() == 2
    assert cache.cached_pages == 2 and cache.match_prefix("v1", seq(1, 2, page_size=4)).pages == kept
    cache.check_invariants()  # includes: the emptied "v2" root is gone
    cache.unlock(held.node)
    assert cache.reset() == 2 and cache.cached_pages == 0
    cache.check_invariants()


def test_counters() -> None:
    cache = make_cache(4)
    cache_sequence(cache, None, seq(1, 2, page_size=4))
    cache.match_prefix(None, seq(1, 2, 3, page_size=4))
    cache.match_prefix(None, seq(9, page_size=4))
    assert (cache.queried_tokens, cache.hit_tokens, cache.miss_tokens) == (16, 8, 8)


def test_misuse_raises() -> None:
    cache = make_cache(4)
    tokens = seq(1, page_size=4)
    cache_sequence(cache, None, tokens)
    match = cache.match_prefix(None, tokens)
    with pytest.raises(ValueError, match="without a matching lock"):
        cache.unlock(match.node)
    cache.evict(1)
    with pytest.raises(ValueError, match="evicted"):
        cache.lock(match.node)
