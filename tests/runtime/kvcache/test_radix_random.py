"""RadixCache against a brute-force model over thousands of random scheduler-like operations.

The model keeps the cached set as a dict from (namespace, page-aligned token prefix) to the page
holding that prefix's last page. Requests start by matching and locking, allocate pages (evicting
when short), decode, insert themselves while running, finish or abort; the cache is evicted and
reset at random. After every operation: the tree's invariants, every page owned exactly once,
locked pages never freed, and matches equal to the model's longest cached prefix.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Hashable

import pytest

from kiln.runtime.kvcache import PageAllocator, PrefixMatch, RadixCache, RadixNode

NAMESPACES: list[Hashable] = [None, ("lora", "a"), 7]
MAX_RUNNING = 6
OPERATIONS = 3000


@dataclass
class Request:
    namespace: Hashable
    tokens: list[int]
    pages: list[int]  # one per started page of tokens; the first `shared` belong to the tree (locked)
    shared: int
    node: RadixNode

    def own_pages(self) -> list[int]:
        return self.pages[self.shared:]


class Model:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.page_of: dict[tuple[Hashable, tuple[int, ...]], int] = {}
        self.key_of: dict[int, tuple[Hashable, tuple[int, ...]]] = {}
        self.ever_inserted: set[tuple[Hashable, tuple[int, ...]]] = set()

    def key(self, namespace: Hashable, tokens: list[int], page_index: int) -> tuple[Hashable, tuple[int, ...]]:
        return namespace, tuple(tokens[: (page_index + 1) * self.page_size])

    def cached_pages(self, namespace: Hashable, tokens: list[int]) -> list[int]:
        pages: list[int] = []
        while (len(pages) + 1) * self.page_size <= len(tokens):
            page = self.page_of.get(self.key(namespace, tokens, len(pages)))
            if page is None:
                break
            pages.append(page)
        return pages

    def add(self, namespace: Hashable, tokens: list[int], pages: list[int], first_new: int) -> None:
        for index in range(first_new, len(pages)):
            key = self.key(namespace, tokens, index)
            assert key not in self.page_of
            self.page_of[key] = pages[index]
            self.key_of[pages[index]] = key
            self.ever_inserted.add(key)

    def forget_freed(self, allocator: PageAllocator) -> None:
        for page in [page for page in self.key_of if allocator.is_free(page)]:
            del self.page_of[self.key_of.pop(page)]


class Simulation:
    def __init__(self, page_size: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.page_size = page_size
        self.allocator = PageAllocator(48)
        self.cache = RadixCache(self.allocator, page_size)
        self.model = Model(page_size)
        self.running: list[Request] = []
        self.history: list[list[int]] = []

    def random_tokens(self) -> list[int]:
        size, rng = self.page_size, self.rng
        tokens: list[int] = []
        if self.history and rng.random() < 0.7:
            base = rng.choice(self.history)
            tokens = base[: rng.randint(0, min(len(base), 5 * size))]
        tokens += [rng.randrange(4) for _ in range(rng.randint(1, 3 * size))]
        self.history.append(tokens)
        return tokens

    def match(self, namespace: Hashable, tokens: list[int]) -> PrefixMatch:
        match = self.cache.match_prefix(namespace, tokens)
        expected = self.model.cached_pages(namespace, tokens)
        assert match.length % self.page_size == 0 and match.length <= len(tokens)
        assert match.pages == expected and match.length == len(expected) * self.page_size
        assert match.length == 0 or (namespace, tuple(tokens[: match.length])) in self.model.ever_inserted
        return match

    def alloc(self, n: int) -> list[int] | None:
        pages = self.allocator.alloc(n)
        if pages is None:
            self.cache.evict(n - self.allocator.free_count)
            self.model.forget_freed(self.allocator)
            pages = self.allocator.alloc(n)
        return pages

    def pages_needed(self, tokens: list[int]) -> int:
        return -(-len(tokens) // self.page_size)

    def start(self) -> None:
        namespace = self.rng.choice(NAMESPACES)
        tokens = self.random_tokens()
        match = self.match(namespace, tokens[:-1])  # keep a token to compute logits from
        self.cache.lock(match.node)
        pages = self.alloc(self.pages_needed(tokens) - len(match.pages))
        if pages is None:
            self.cache.unlock(match.node)
            return
        self.running.append(Request(namespace, tokens, match.pages + pages, len(match.pages), match.node))

    def decode(self, request: Request) -> None:
        request.tokens += [self.rng.randrange(4) for _ in range(self.rng.randint(1, self.page_size))]
        pages = self.alloc(self.pages_needed(request.tokens) - len(request.pages))
        if pages is None:
            self.abort(request)
        else:
            request.pages += pages

    def insert_running(self, request: Request) -> None:
        full = len(request.tokens) // self.page_size
        already = len(self.model.cached_pages(request.namespace, request.tokens[: full * self.page_size]))
        now = self.cache.insert_running(request.namespace, request.tokens, request.pages[:full], request.node)
        assert now.length == full * self.page_size and now.pages[:request.shared] == request.pages[:request.shared]
        for mine, tree in zip(request.pages[:full], now.pages):
            assert mine == tree or self.allocator.is_free(mine)
        self.model.add(request.namespace, request.tokens, now.pages, already)
        request.pages[:full] = now.pages
        request.shared, request.node = full, now.node

    def finish(self, request: Request) -> None:
        full = len(request.tokens) // self.page_size
        expected = self.model.cached_pages(request.namespace, request.tokens[: full * self.page_size])
        given = request.pages[:full]
        assert self.cache.insert(request.namespace, request.tokens, given) == len(expected) * self.page_size
        for mine, tree in zip(given, expected):
            assert mine == tree or self.allocator.is_free(mine)
        self.model.add(request.namespace, request.tokens, given, len(expected))
        self.allocator.free(request.pages[full:])
        self.cache.unlock(request.node)
        self.running.remove(request)

    def abort(self, request: Request) -> None:
        self.allocator.free(request.own_pages())
        self.cache.unlock(request.node)
        self.running.remove(request)

    def step(self) -> None:
        rng, cache = self.rng, self.cache
        roll = rng.random()
        if roll < 0.25 and len(self.running) < MAX_RUNNING:
            self.start()
        elif roll < 0.45 and self.running:
            self.decode(rng.choice(self.running))
        elif roll < 0.55 and self.running:
            self.insert_running(rng.choice(self.running))
        elif roll < 0.72 and self.running:
            self.finish(rng.choice(self.running))
        elif roll < 0.76 and self.running:
            self.abort(rng.choice(self.running))
        elif roll < 0.86:
            cache.evict(rng.randint(1, 10))
            self.model.forget_freed(self.allocator)
        elif roll < 0.99:
            self.match(rng.choice(NAMESPACES), rng.choice(self.history) if self.history else [1])
        else:
            cache.reset()
            self.model.forget_freed(self.allocator)

    def check(self) -> None:
        held = [page for request in self.running for page in request.own_pages()]
        self.cache.check_invariants(held_pages=held)
        assert self.cache.cached_pages == len(self.model.page_of)
        for request in self.running:
            tree_pages = request.pages[:request.shared]
            assert not any(self.allocator.is_free(page) for page in tree_pages), "a locked page was freed"
            prefix = request.tokens[: request.shared * self.page_size]
            assert self.model.cached_pages(request.namespace, prefix) == tree_pages


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_random_operations_match_the_model(page_size: int, seed: int) -> None:
    sim = Simulation(page_size, seed)
    for _ in range(OPERATIONS):
        sim.step()
        sim.check()
    assert sim.cache.hit_tokens > 0 and sim.cache.evicted_tokens > 0  # the run exercised sharing and eviction
    while sim.running:
        sim.finish(sim.running[-1])
    sim.check()
    assert sim.cache.evictable_pages == sim.cache.cached_pages
    sim.cache.evict(sim.allocator.total)
    assert sim.allocator.free_count == sim.allocator.total
    assert sim.cache.cached_pages == 0 and sim.cache.evictable_pages == 0
    sim.cache.check_invariants()
