"""Fusing each layer's rope + KV store into the attention that reads what it wrote.

Before:  %qr, %kc, %vc = rope_kv_store(%q, %k, %v, %positions, @cos_sin, %k_cache, %v_cache, %slots) {eps=0.0}
         %a = paged_attention(%qr, %kc, %vc, %q_start, %q_len, %kv_len, %page_table) {...}
After:   %a, %kc, %vc = rope_kv_attention(%q, %k, %v, %positions, @cos_sin, %k_cache, %v_cache, %slots,
                                          %q_start, %q_len, %kv_len, %page_table) {...}

A decode step then rotates and stores inside the attention kernel: one launch a layer fewer, on
the path where a small model's step is a chain of a few hundred launches. Only a store without
q/k norm fuses (Qwen3's normed variant keeps its generated kernel), and only when the rotated q
has no reader but this attention and the attention reads exactly the caches the store wrote.
"""

from __future__ import annotations

from kiln.ir import Graph, Node

from .base import PassContext
from .patterns import Match, Rule, op, rewrite, var

_STORE_INPUTS = ("q", "k", "v", "positions", "cos_sin", "k_cache", "v_cache", "slots")
_SEQUENCES = ("q_start", "q_len", "kv_len", "page_table")
_TREE = "tree_mask"  # optional (passes/tree_attention.py)


def _build(m: Match) -> Node:
    store = m.nodes["store"]
    inputs = [m[name] for name in (*_STORE_INPUTS, *_SEQUENCES, _TREE)]
    return m.make("rope_kv_attention", inputs, [m.root.out, *store.outputs[1:]], m.root.attrs)


# Eight inputs: a store with q/k norms does not match.
_STORE = op("rope_kv_store", *map(var, _STORE_INPUTS), name="store")
STORE_INTO_ATTENTION = Rule(op("paged_attention", _STORE, op("rope_kv_store", name="store", output=1),
                               op("rope_kv_store", name="store", output=2), *map(var, _SEQUENCES),
                               var(_TREE, optional=True)), _build)


def fuse_rope_attention(graph: Graph, ctx: PassContext) -> Graph:
    return rewrite(graph, ctx, STORE_INTO_ATTENTION)
