"""The page allocator: which pages of the KV pool are free.

Pages are numbered ``0 .. num_pages - 1``. Page 0 is reserved and never handed out, so padded rows
of a page table can point at it without touching anyone's KV. ``alloc`` is all-or-nothing and
``free`` checks every page before changing anything, so a caller's bug (a double free, a page out of
range, the reserved page) raises and leaves the allocator as it was. Each call costs O(pages moved),
never O(pool size).
"""

from __future__ import annotations

from typing import Sequence

RESERVED_PAGE = 0


class PageAllocator:
    __slots__ = ("num_pages", "_free_stack", "_is_free")

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"a pool needs at least 2 pages (page {RESERVED_PAGE} is reserved), got {num_pages}")
        self.num_pages = num_pages
        # A stack: alloc takes from the end. Initially ordered so that the first pages handed out are 1, 2, 3...
        self._free_stack: list[int] = list(range(num_pages - 1, RESERVED_PAGE, -1))
        self._is_free = bytearray([1]) * num_pages
        self._is_free[RESERVED_PAGE] = 0

    @property
    def total(self) -> int:
        """Pages that can ever be handed out (the reserved page excluded)."""
        return self.num_pages - 1

    @property
    def free_count(self) -> int:
        return len(self._free_stack)

    @property
    def used_count(self) -> int:
        return self.total - len(self._free_stack)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` distinct free pages, now owned by the caller; None (and nothing taken) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        stack = self._free_stack
        if n > len(stack):
            return None
        if n == 0:
            return []
        pages = stack[-n:]
        del stack[-n:]
        pages.reverse()
        is_free = self._is_free
        for page in pages:
            is_free[page] = 0
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Give ``pages`` back. Raises ValueError, changing nothing, on a page that is not currently allocated."""
        is_free = self._is_free
        for page in pages:
            if not 0 < page < self.num_pages:
                raise ValueError(f"page {page} is the reserved page or outside the pool of {self.num_pages}")
            if is_free[page]:
                raise ValueError(f"double free of page {page}")
        if len(set(pages)) != len(pages):
            raise ValueError(f"pages freed twice in one call: {sorted(pages)}")
        for page in pages:
            is_free[page] = 1
        self._free_stack.extend(pages)

    def is_free(self, page: int) -> bool:
        return bool(self._is_free[page])

    def free_pages(self) -> list[int]:
        """A copy of the free list, for invariant checks in tests (O(pool size))."""
        return list(self._free_stack)
