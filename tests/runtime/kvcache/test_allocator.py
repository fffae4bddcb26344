"""PageAllocator: all-or-nothing allocation, the reserved page, and frees that are checked before they happen."""

from __future__ import annotations

import pytest

from kiln.runtime.kvcache import RESERVED_PAGE, PageAllocator


def test_fresh_allocator_hands_out_every_page_but_the_reserved_one() -> None:
    allocator = PageAllocator(8)
    assert allocator.total == 7 and allocator.free_count == 7 and allocator.used_count == 0
    pages = allocator.alloc(7)
    assert pages == [1, 2, 3, 4, 5, 6, 7]
    assert RESERVED_PAGE not in pages
    assert allocator.free_count == 0 and allocator.used_count == 7
    assert allocator.alloc(1) is None


def test_alloc_is_never_partial() -> None:
    allocator = PageAllocator(5)
    assert allocator.alloc(3) is not None
    assert allocator.alloc(2) is None
    assert allocator.free_count == 1
    assert allocator.alloc(0) == []
    with pytest.raises(ValueError):
        allocator.alloc(-1)


def test_freed_pages_are_reused() -> None:
    allocator = PageAllocator(4)
    first = allocator.alloc(3)
    allocator.free(first[1:])
    assert allocator.free_count == 2
    again = allocator.alloc(2)
    assert sorted(again) == sorted(first[1:])
    assert not any(allocator.is_free(p) for p in first)


@pytest.mark.parametrize("bad", [[RESERVED_PAGE], [9], [-1]])
def test_freeing_reserved_or_out_of_range_page_raises(bad: list[int]) -> None:
    allocator = PageAllocator(9)
    allocator.alloc(8)
    with pytest.raises(ValueError):
        allocator.free(bad)
    assert allocator.free_count == 0


def test_double_free_raises_and_changes_nothing() -> None:
    allocator = PageAllocator(6)
    pages = allocator.alloc(4)
    allocator.free(pages[:1])
    with pytest.raises(ValueError, match="double free"):
        allocator.free([pages[1], pages[0]])
    assert allocator.free_count == 2 and not allocator.is_free(pages[1])
    with pytest.raises(ValueError, match="twice in one call"):
        allocator.free([pages[2], pages[2]])
    assert allocator.free_count == 2 and not allocator.is_free(pages[2])


def test_free_pages_lists_exactly_the_free_ones() -> None:
    allocator = PageAllocator(6)
    taken = allocator.alloc(3)
    assert sorted(allocator.free_pages() + taken) == [1, 2, 3, 4, 5]


def test_needs_a_usable_page() -> None:
    with pytest.raises(ValueError):
        PageAllocator(1)
