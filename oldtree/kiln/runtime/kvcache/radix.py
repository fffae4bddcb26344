"""The radix prefix cache: a tree over token-id sequences whose nodes own KV pages.

Keys are page-aligned: a node's key is ``k * page_size`` token ids and it owns the ``k`` pages that
hold their KV. Every key lives in a **namespace** (any hashable: ``None`` for the base model,
``("lora", name)``, a weights version); each namespace has its own root, so entries are never
shared across namespaces.

API (all plain Python on token-id sequences and page numbers; nothing touches tensors):
- ``match_prefix(ns, token_ids) -> PrefixMatch(pages, length, node)``: the longest cached
  page-aligned prefix. ``pages`` are borrowed from the tree: lock ``node`` before the next
  ``evict``/``reset``, or they may be freed and reused. Splits a node when the match ends inside it
  and refreshes the LRU time of the path. To leave at least one token to compute logits from, match
  ``token_ids[:-1]``.
- ``peek_prefix`` / ``cached_length``: the same match, not counted in the hit counters.
- ``lock(node)`` / ``unlock(node)``: a running request's reference on the path node..root; locked
  nodes are never evicted. A handle stays valid across splits (the node keeps its identity as the
  lower half); locking a node that was already evicted raises.
- ``insert(ns, token_ids, pages) -> int``: caches ``token_ids[: len(pages) * page_size]`` whose KV
  is in ``pages`` (whole pages only; the caller frees its partial last page itself). The tree takes
  ownership of every page passed: pages the tree already holds at that position stay, pages
  duplicating an existing entry are freed to the allocator, the rest become new entries. Returns
  the number of those tokens that were already cached.
- ``insert_running(ns, token_ids, pages, locked_node) -> PrefixMatch``: ``insert`` for a request
  that keeps running: the returned ``pages`` replace the request's first ``len(pages)`` pages
  (duplicates were freed), the returned node is locked and ``locked_node`` unlocked.
- ``evict(num_pages) -> int``: frees at least ``num_pages`` pages when possible by removing unlocked
  leaves, least recently used first (a parent left childless becomes a candidate); whole nodes go,
  so it may free more. Returns the count freed.
- ``reset() -> int``: frees every unlocked entry (for a weights change). Locked entries stay until
  unlocked; give new weights a new namespace so those are never matched again.
- Counters: ``hit_tokens``, ``queried_tokens``, ``miss_tokens`` (per ``match_prefix`` call),
  ``evicted_tokens``, ``cached_pages``, ``evictable_pages``.

Ownership rules: a page is owned by exactly one of the allocator's free list, the tree, or a caller
that allocated it. Pages from ``match_prefix`` stay the tree's. ``insert`` moves the caller's pages
to the tree (or frees them), so after it the caller owns none of them.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence

from .allocator import RESERVED_PAGE, PageAllocator


class RadixNode:
    """One edge of the tree: ``key`` tokens and the pages holding their KV. A root has ``parent`` None."""

    __slots__ = ("namespace", "key", "pages", "children", "parent", "lock_count", "last_access", "alive", "in_heap")

    def __init__(self, namespace: Hashable, key: tuple[int, ...], pages: list[int], parent: RadixNode | None,
                 last_access: int) -> None:
        self.namespace = namespace
        self.key = key
        self.pages = pages
        # Keyed by the first page of the child's key: siblings always differ in their first page.
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.parent = parent
        self.lock_count = 0
        self.last_access = last_access
        self.alive = True
        self.in_heap = False  # at most one eviction-heap entry per node keeps the heap bounded by the tree


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The cached prefix: ``length`` tokens in ``pages`` (the tree's), ending at ``node`` (lock it to keep them)."""

    pages: list[int]
    length: int
    node: RadixNode


class RadixCache:
    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self._roots: dict[Hashable, RadixNode] = {}
        self._clock = 0
        # Entries (last_access when pushed, tie-break, node). Stale entries are fixed when popped:
        # access times only grow, so an entry's time is never later than its node's.
        self._heap: list[tuple[int, int, RadixNode]] = []
        self._pushes = 0
        self.hit_tokens = 0
        self.queried_tokens = 0
        self.evicted_tokens = 0
        self.cached_pages = 0
        self.evictable_pages = 0

    @property
    def miss_tokens(self) -> int:
        return self.queried_tokens - self.hit_tokens

    def match_prefix(self, namespace: Hashable, token_ids: Sequence[int]) -> PrefixMatch:
        match = self._walk(namespace, token_ids)
        self.queried_tokens += len(token_ids)
        self.hit_tokens += match.length
        return match

    def cached_length(self, namespace: Hashable, token_ids: Sequence[int]) -> int:
        """How many leading tokens ``match_prefix`` would find, without counting it as a query."""
        return self._walk(namespace, token_ids).length

    def peek_prefix(self, namespace: Hashable, token_ids: Sequence[int]) -> PrefixMatch:
        """``match_prefix`` without counting it as a query (for reading the cache, not serving a request)."""
        return self._walk(namespace, token_ids)

    def lock(self, node: RadixNode) -> None:
        if not node.alive:
            raise ValueError("cannot lock an evicted node: lock a match before the next evict or reset")
        while node.parent is not None:
            if node.lock_count == 0:
                self.evictable_pages -= len(node.pages)
            node.lock_count += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node.parent is not None:
            if node.lock_count <= 0:
                raise ValueError("unlock without a matching lock")
            node.lock_count -= 1
            if node.lock_count == 0:
                self.evictable_pages += len(node.pages)
                if not node.children:
                    self._push(node)
            node = node.parent

    def insert(self, namespace: Hashable, token_ids: Sequence[int], pages: Sequence[int]) -> int:
        size = self.page_size
        length = len(pages) * size
        if len(token_ids) < length:
            raise ValueError(f"{len(pages)} pages need {length} token ids, got {len(token_ids)}")
        if not pages:
            return 0  # nothing to cache; creating a root here would leave an empty namespace behind
        tokens = tuple(token_ids[:length])
        self._clock += 1
        node = self._roots.get(namespace)
        if node is None:
            node = self._roots[namespace] = RadixNode(namespace, (), [], None, self._clock)
        node.last_access = self._clock
        duplicates: list[int] = []
        pos = 0
        while pos < length:
            child = node.children.get(tokens[pos:pos + size])
            if child is None:
                leaf = RadixNode(namespace, tokens[pos:], list(pages[pos // size:]), node, self._clock)
                node.children[tokens[pos:pos + size]] = leaf
                self.cached_pages += len(leaf.pages)
                self.evictable_pages += len(leaf.pages)
                self._push(leaf)
                break
            matched = self._matched_tokens(child.key, tokens, pos)
            if matched < len(child.key) and pos + matched < length:
                child = self._split(child, matched)  # the new tokens branch off inside this node
            child.last_access = self._clock
            first = pos // size
            # A page the tree already holds at this position is the caller's matched prefix: keep it.
            duplicates.extend(p for p, own in zip(pages[first:first + matched // size], child.pages) if p != own)
            pos += matched
            node = child
        self.allocator.free(duplicates)
        return pos

    def insert_running(self, namespace: Hashable, token_ids: Sequence[int], pages: Sequence[int],
                       locked_node: RadixNode) -> PrefixMatch:
        self.insert(namespace, token_ids, pages)
        match = self._walk(namespace, token_ids[:len(pages) * self.page_size])
        self.lock(match.node)
        self.unlock(locked_node)
        return match

    def evict(self, num_pages: int) -> int:
        heap = self._heap
        freed: list[int] = []
        while len(freed) < num_pages and heap:
            stamp, _, node = heapq.heappop(heap)
            node.in_heap = False
            if not node.alive or node.children or node.lock_count:
                continue  # no longer a candidate; it is pushed again when it becomes one
            if stamp != node.last_access:
                self._push(node)  # touched since it was pushed: requeue at its real time
                continue
            freed.extend(node.pages)
            self._remove_leaf(node)
        self.allocator.free(freed)
        return len(freed)

    def reset(self) -> int:
        return self.evict(self.evictable_pages)

    def locked_nodes(self) -> int:
        """Nodes some running request holds a lock on (0 when idle; a walk of the tree, for metrics)."""
        count = 0
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            count += node.parent is not None and node.lock_count > 0
            stack.extend(node.children.values())
        return count

    def check_invariants(self, held_pages: Iterable[int] = ()) -> None:
        """Assert the tree is consistent and every usable page has exactly one owner: the tree, the
        allocator's free list, or ``held_pages`` (the pages callers hold outside the tree)."""
        size = self.page_size
        owners = Counter(self.allocator.free_pages())
        owners.update(held_pages)
        cached = evictable = 0
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            assert node.alive and node.lock_count >= 0
            assert len(node.key) == len(node.pages) * size, "key not page-aligned to its pages"
            assert node.parent is not None or node.children, "an empty namespace root was kept"
            if node.parent is not None:
                assert node.key, "empty key below a root"
                assert node.lock_count <= node.parent.lock_count or node.parent.parent is None
                assert node.last_access <= node.parent.last_access or node.parent.parent is None
                if node.lock_count == 0:
                    evictable += len(node.pages)
                    assert node.children or node.in_heap, "evictable leaf missing from the eviction heap"
            cached += len(node.pages)
            owners.update(node.pages)
            for first, child in node.children.items():
                assert child.parent is node and child.key[:size] == first
                stack.append(child)
        assert cached == self.cached_pages and evictable == self.evictable_pages, "page counters drifted"
        assert RESERVED_PAGE not in owners, "reserved page is owned"
        expected = set(range(1, self.allocator.num_pages))
        twice = [page for page, count in owners.items() if count > 1]
        assert not twice, f"pages owned twice: {sorted(twice)[:20]}"
        assert set(owners) == expected, f"pages without an owner: {sorted(expected - set(owners))[:20]}"

    def _walk(self, namespace: Hashable, token_ids: Sequence[int]) -> PrefixMatch:
        size = self.page_size
        usable = len(token_ids) - len(token_ids) % size
        node = self._roots.get(namespace)
        if node is None:
            return PrefixMatch([], 0, RadixNode(namespace, (), [], None, 0))  # a detached root: lock/unlock skip it
        tokens = tuple(token_ids[:usable])
        self._clock += 1
        node.last_access = self._clock
        pages: list[int] = []
        pos = 0
        while pos < usable:
            child = node.children.get(tokens[pos:pos + size])
            if child is None:
                break
            matched = self._matched_tokens(child.key, tokens, pos)
            if matched < len(child.key):
                child = self._split(child, matched)
            child.last_access = self._clock
            pages.extend(child.pages)
            pos += matched
            node = child
        return PrefixMatch(pages, pos, node)

    def _matched_tokens(self, key: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
        """Length of the longest page-aligned common prefix of ``key`` and ``tokens[start:]`` (both aligned)."""
        n = min(len(key), len(tokens) - start)
        if key[:n] == tokens[start:start + n]:
            return n
        first_diff = next(i for i, (a, b) in enumerate(zip(key, tokens[start:start + n])) if a != b)
        return first_diff - first_diff % self.page_size

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut ``node`` after ``at`` tokens; the new upper half is returned, ``node`` stays as the lower half
        so handles to it stay valid. Every lock through ``node`` also runs through the upper half."""
        head = RadixNode(node.namespace, node.key[:at], node.pages[:at // self.page_size], node.parent,
                         node.last_access)
        head.lock_count = node.lock_count
        node.parent.children[node.key[:self.page_size]] = head
        node.key = node.key[at:]
        node.pages = node.pages[at // self.page_size:]
        node.parent = head
        head.children[node.key[:self.page_size]] = node
        return head

    def _push(self, node: RadixNode) -> None:
        if not node.in_heap:
            node.in_heap = True
            self._pushes += 1
            heapq.heappush(self._heap, (node.last_access, self._pushes, node))

    def _remove_leaf(self, node: RadixNode) -> None:
        parent = node.parent
        del parent.children[node.key[:self.page_size]]
        node.alive = False
        self.cached_pages -= len(node.pages)
        self.evictable_pages -= len(node.pages)
        self.evicted_tokens += len(node.key)
        if parent.children:
            return
        if parent.parent is not None:
            if parent.lock_count == 0:
                self._push(parent)
        elif self._roots.get(parent.namespace) is parent:
            # A namespace whose entries are all gone (an old weights version) costs nothing afterwards.
            del self._roots[parent.namespace]
