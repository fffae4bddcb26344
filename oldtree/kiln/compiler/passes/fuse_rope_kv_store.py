"""Fusing each attention layer's rotary embedding, KV store (and Qwen3's q/k norm) into one op.

Before:  [%qn = rmsnorm(%q, @q_norm); %kn = rmsnorm(%k, @k_norm)]
         %qr = rope(%qn, %positions, @cos_sin); %kr = rope(%kn, %positions, @cos_sin)
         %kc, %vc = kv_store(%k_cache, %v_cache, %kr, %v, %slots)
         %a = paged_attention(%qr, %kc, %vc, ...)
After:   %qr, %kc, %vc = rope_kv_store(%q, %k, %v, %positions, @cos_sin, %k_cache, %v_cache, %slots
                                       [, @q_norm, @k_norm]) {eps=…}
         %a = paged_attention(%qr, %kc, %vc, ...)

One kernel then reads q, k and v once and writes rotated q and the pool: three to five launches
become one on the decode path. The fused node sits where the store was; every value it absorbs
had no reader other than the next op in the chain, which the pass checks.
"""

from __future__ import annotations

from kiln.ir import Graph, Node

from .base import PassContext
from .patterns import Match, Pattern, Rule, op, rewrite, var


def _build(m: Match) -> Node | None:
    norms, attrs = [], {}
    if "q_normed" in m.nodes:
        eps = m.nodes["q_normed"].attrs["eps"]
        if m.nodes["k_normed"].attrs["eps"] != eps:
            return None
        norms, attrs = [m["q_norm"], m["k_norm"]], {"eps": eps}
    store = m.nodes["store"]
    inputs = [m["q"], m["k"], m["v"], m["positions"], m["cos_sin"], m["k_cache"], m["v_cache"], m["slots"], *norms]
    return m.make("rope_kv_store", inputs, [m.nodes["q_rope"].out, *store.outputs], attrs)


def _rope(which: str, x: Pattern) -> Pattern:
    return op("rope", x, var("positions"), var("cos_sin"), name=f"{which}_rope")


def _normed(which: str) -> Pattern:
    return op("rmsnorm", var(which), var(f"{which}_norm"), name=f"{which}_normed")


def _rule(q: Pattern, k: Pattern) -> Rule:
    """The attention is context: the fused op takes the store's place, and the attention reads its outputs."""
    store = op("kv_store", var("k_cache"), var("v_cache"), _rope("k", k), var("v"), var("slots"), name="store",
               shared=True)
    attention = op("paged_attention", _rope("q", q), store, op("kv_store", name="store", output=1), ..., keep=True)
    return Rule(attention, _build, at="store")


# With Qwen3's q/k norms first; norms that differ in eps or are read elsewhere stay outside.
ROPE_INTO_STORE = (_rule(_normed("q"), _normed("k")), _rule(var("q"), var("k")))


def fuse_rope_kv_store(graph: Graph, ctx: PassContext) -> Graph:
    return rewrite(graph, ctx, *ROPE_INTO_STORE)
