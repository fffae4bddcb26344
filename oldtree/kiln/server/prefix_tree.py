"""The router's picture of each replica's prefix cache: a radix tree over the token ids of the
prompts it sent to each replica (as SGLang's router keeps one over text).

Each node is an edge of token ids; it records which replicas were sent the prefix ending there and
when (a tick counter) they last were. Inserting a prompt marks its whole path for that replica, so
a node's replicas are a subset of its parent's, and ``match`` reads, for every replica, the length
of the longest prefix of a prompt that replica holds. The replicas' own radix caches evict pages the
tree cannot see; the tree is an approximation, kept to ``max_tokens`` token ids by dropping the
least recently used leaves (for every replica at once) once it grows past that.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

# Eviction trims to this share of max_tokens, so it runs once per many inserts rather than on each.
EVICT_TO = 0.9


class _Node:
    __slots__ = ("key", "children", "parent", "replicas")

    def __init__(self, key: tuple[int, ...], parent: "_Node | None") -> None:
        self.key = key
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.replicas: dict[int, int] = {}  # replica -> tick of its last prompt through this node


def _common_length(key: tuple[int, ...], tokens: Sequence[int], start: int) -> int:
    limit = min(len(key), len(tokens) - start)
    length = 0
    while length < limit and key[length] == tokens[start + length]:
        length += 1
    return length


class PrefixTree:
    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.root = _Node((), None)
        self.tokens = 0                     # token ids on all edges
        self.held: dict[int, int] = {}      # replica -> token ids of the prefixes it holds
        self._tick = 0

    def match(self, tokens: Sequence[int]) -> dict[int, int]:
        """Replica -> the length of the longest prefix of ``tokens`` it was sent (absent: none)."""
        matched: dict[int, int] = {}
        node, depth = self.root, 0
        while depth < len(tokens) and (child := node.children.get(tokens[depth])) is not None:
            length = _common_length(child.key, tokens, depth)
            depth += length
            for replica in child.replicas:  # deeper nodes hold fewer replicas: the last write is the longest
                matched[replica] = depth
            if length < len(child.key):
                break
            node = child
        return matched

    def insert(self, tokens: Sequence[int], replica: int) -> None:
        """Records that ``replica`` was sent ``tokens`` (and so holds every prefix of it)."""
        self._tick += 1
        node, depth = self.root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                child = _Node(tuple(tokens[depth:]), node)
                node.children[child.key[0]] = child
                self.tokens += len(child.key)
                self._mark(child, replica)
                break
            length = _common_length(child.key, tokens, depth)
            if length < len(child.key):
                child = self._split(child, length)
            self._mark(child, replica)
            depth += length
            node = child
        if self.tokens > self.max_tokens:
            self._evict(int(self.max_tokens * EVICT_TO))

    def _mark(self, node: _Node, replica: int) -> None:
        if replica not in node.replicas:
            self.held[replica] = self.held.get(replica, 0) + len(node.key)
        node.replicas[replica] = self._tick

    def _split(self, node: _Node, length: int) -> _Node:
        """Cuts ``node``'s edge after ``length`` ids; returns the new upper node (same replicas)."""
        upper = _Node(node.key[:length], node.parent)
        upper.replicas = dict(node.replicas)
        node.parent.children[upper.key[0]] = upper
        node.key, node.parent = node.key[length:], upper
        upper.children[node.key[0]] = node
        return upper

    def _evict(self, target: int) -> None:
        leaves = [(max(n.replicas.values()), id(n), n) for n in self._nodes() if not n.children]
        heapq.heapify(leaves)
        while self.tokens > target and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            self.tokens -= len(leaf.key)
            for replica in leaf.replicas:
                self.held[replica] -= len(leaf.key)
            if parent is not self.root and not parent.children:
                heapq.heappush(leaves, (max(parent.replicas.values()), id(parent), parent))

    def _nodes(self) -> list[_Node]:
        found, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            found.append(node)
            stack.extend(node.children.values())
        return found
