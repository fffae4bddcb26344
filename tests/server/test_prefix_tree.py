"""The router's prefix tree: longest prefix per replica, edge splits, and LRU eviction, checked
against a plain reference (every prompt each replica was sent, compared token by token)."""

from __future__ import annotations

import random

from kiln.server.prefix_tree import PrefixTree


def reference_match(sent: list[tuple[int, list[int]]], tokens: list[int]) -> dict[int, int]:
    best: dict[int, int] = {}
    for replica, prompt in sent:
        length = 0
        while length < min(len(prompt), len(tokens)) and prompt[length] == tokens[length]:
            length += 1
        if length:
            best[replica] = max(best.get(replica, 0), length)
    return best


def test_match_gives_each_replica_its_longest_prefix():
    tree = PrefixTree(max_tokens=1000)
    tree.insert([1, 2, 3, 4, 5], replica=0)
    tree.insert([1, 2, 3, 9], replica=1)   # splits the first edge after 3
    tree.insert([7, 8], replica=1)
    assert tree.match([1, 2, 3, 4, 6]) == {0: 4, 1: 3}
    assert tree.match([1, 2]) == {0: 2, 1: 2}
    assert tree.match([7, 8, 9]) == {1: 2}
    assert tree.match([5]) == {}
    assert tree.tokens == 8 and tree.held == {0: 5, 1: 6}


def test_random_prompts_match_the_reference():
    rng = random.Random(0)
    stems = [[rng.randrange(50) for _ in range(rng.randrange(1, 12))] for _ in range(6)]
    tree, sent = PrefixTree(max_tokens=10**6), []
    for _ in range(300):
        prompt = rng.choice(stems)[: rng.randrange(1, 13)] + [rng.randrange(50) for _ in range(rng.randrange(4))]
        assert tree.match(prompt) == reference_match(sent, prompt)
        replica = rng.randrange(3)
        tree.insert(prompt, replica)
        sent.append((replica, prompt))


def test_eviction_drops_the_least_recently_used_leaves():
    tree = PrefixTree(max_tokens=10)
    tree.insert([1, 2, 3, 4], replica=0)
    tree.insert([5, 6, 7, 8], replica=1)
    tree.insert([1, 2, 3, 4], replica=0)       # used again: now the most recent
    tree.insert([9, 10, 11, 12], replica=1)    # 12 tokens > 10: trims to 9, dropping [5..8]
    assert tree.tokens == 8 and tree.held == {0: 4, 1: 4}
    assert tree.match([5, 6]) == {} and tree.match([1, 2, 3, 4]) == {0: 4}
