"""Draft trees: a request's drafts as a tree under its last token, and how one is chosen, cut, laid
out in a step and walked by the target's choices.

Node ``i`` of a ``DraftTree`` has token ``tokens[i]`` and parent ``parents[i]`` (an earlier node, or
-1: the root, the request's last token). A chain (n-gram drafts, EAGLE at top-k 1) is the tree whose
node ``i`` has parent ``i - 1``. In a verify step the root and the nodes sit side by side in the
context (root at the request's next position, node ``i`` at ``i + 1`` after it), each at the
position of its depth, attending to its ancestors only (``tree_mask_rows``; plain causal for a chain).

EAGLE-2's dynamic trees, as SGLang builds them (``select_nodes``): each draft step expands the
``topk`` best nodes so far (by cumulative draft probability, the product along the path) into their
``topk`` likeliest children; after the last step the ``num_nodes`` best of every candidate are kept,
in the order they were made (a parent before its children: a child's score is at most its parent's).
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.kernels.attention_block import TREE_WINDOW_KEYS

# Verified tokens a tree may bring (its root too): the tree mask covers the context's last keys.
MAX_TREE_TOKENS = TREE_WINDOW_KEYS


@dataclass(frozen=True)
class DraftTree:
    tokens: list[int]
    parents: list[int]

    @staticmethod
    def chain(tokens: list[int]) -> "DraftTree":
        return DraftTree(list(tokens), list(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(parent == i - 1 for i, parent in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Each node's depth: 1 for a child of the root."""
        depth: list[int] = []
        for parent in self.parents:
            depth.append(1 if parent < 0 else depth[parent] + 1)
        return depth

    def children(self) -> list[list[int]]:
        """Per verified row (0: the root, ``i + 1``: node ``i``), its children's node indices, in order."""
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, parent in enumerate(self.parents):
            kids[parent + 1].append(i)
        return kids

    def distinct_children(self) -> list[list[int]]:
        """``children()`` without a node whose token an earlier sibling has (padding repeats a
        token; verification tries each token once)."""
        rows = []
        for kids in self.children():
            seen: set[int] = set()
            rows.append([n for n in kids if not (self.tokens[n] in seen or seen.add(self.tokens[n]))])
        return rows

    def keep(self, nodes: list[int]) -> "DraftTree":
        """The subtree of ``nodes`` (ascending, closed under parents), renumbered."""
        index = {old: new for new, old in enumerate(nodes)}
        return DraftTree([self.tokens[i] for i in nodes],
                         [index[self.parents[i]] if self.parents[i] >= 0 else -1 for i in nodes])

    def cut(self, max_nodes: int, max_depth: int) -> "DraftTree":
        """The first ``max_nodes`` nodes no deeper than ``max_depth`` (a closed subtree: parents come first)."""
        depths = self.depths()
        return self.keep([i for i in range(len(self)) if depths[i] <= max_depth][:max(max_nodes, 0)])

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to ``node``."""
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]


def tree_mask_rows(tree: DraftTree, context_len: int) -> list[int]:
    """The i32 tree-mask rows of a verify step's root and nodes (``kernels/attention.py``): the root
    at context index ``context_len - len(tree) - 1``, node ``i`` just after; each sees the context
    before the root, the root and its ancestors. -1 (all keys) for a chain."""
    if tree.is_chain:
        return [-1] * (len(tree) + 1)
    root = context_len - len(tree) - 1
    return [mask_bits(context_len, root + 1, [])] + \
        [mask_bits(context_len, root + 1, [root + 1 + n for n in tree.path(i)]) for i in range(len(tree))]


def mask_bits(context_len: int, prefix_end: int, keys: list[int]) -> int:
    """The i32 mask row over the last ``TREE_WINDOW_KEYS`` keys of a ``context_len`` context that
    sees every key before ``prefix_end`` and ``keys``."""
    start = context_len - TREE_WINDOW_KEYS
    bits = 0
    for key in [*range(max(start, 0), prefix_end), *keys]:
        if key >= start:
            bits |= 1 << (key - start)
    return bits - (1 << 32) if bits >= 1 << 31 else bits  # as an i32


@dataclass
class Candidates:
    """Every node a tree's draft steps proposed: token, cumulative draft probability, parent candidate (-1: root)."""

    tokens: list[int]
    scores: list[float]
    parents: list[int]

    def add(self, token: int, score: float, parent: int) -> int:
        self.tokens.append(token)
        self.scores.append(score)
        self.parents.append(parent)
        return len(self.tokens) - 1

    def lineage(self, candidate: int) -> list[int]:
        """``candidate`` and its ancestors (the root left out)."""
        nodes = []
        while candidate >= 0:
            nodes.append(candidate)
            candidate = self.parents[candidate]
        return nodes

    def select_nodes(self, num_nodes: int) -> DraftTree:
        """The ``num_nodes`` best candidates (ties: the earlier), in the order they were made."""
        order = sorted(range(len(self.tokens)), key=lambda i: (-self.scores[i], i))[:num_nodes]
        chosen = sorted(order)
        kept = set(chosen)
        # A child's score is at most its parent's and ties favour the earlier, so parents are kept.
        assert all(self.parents[i] < 0 or self.parents[i] in kept for i in chosen)
        index = {old: new for new, old in enumerate(chosen)}
        return DraftTree([self.tokens[i] for i in chosen],
                         [index[self.parents[i]] if self.parents[i] >= 0 else -1 for i in chosen])
