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

from kiln.ir import Graph, Node, make_node

from .base import PassContext, rewrite_nodes, sole_reader


def fuse_rope_attention(graph: Graph, ctx: PassContext) -> Graph:
    producers = graph.producers()
    users = graph.users()
    types = graph.value_types()
    replaced: dict[int, Node] = {}
    absorbed: set[int] = set()
    for attention in graph.nodes:
        if attention.op != "paged_attention":
            continue
        store = producers.get(attention.inputs[0])
        if store is None or store.op != "rope_kv_store" or len(store.inputs) != 8:
            continue
        # The fused node takes the attention's place, so nothing may read the store's outputs in between.
        if store.outputs[1:] != attention.inputs[1:3] or any(
                sole_reader(graph, users, value) is not attention for value in store.outputs):
            continue
        inputs = [*store.inputs, *attention.inputs[3:]]
        fused = make_node("rope_kv_attention", inputs, [attention.out, *store.outputs[1:]],
                          [types[i] for i in inputs], dict(attention.attrs))
        replaced[id(attention)] = fused
        absorbed.add(id(store))
    return rewrite_nodes(graph, replaced, absorbed)
