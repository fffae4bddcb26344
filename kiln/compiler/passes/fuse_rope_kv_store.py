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

from kiln.ir import Graph, Node, make_node

from .base import PassContext, rewrite_nodes, sole_reader


def fuse_rope_kv_store(graph: Graph, ctx: PassContext) -> Graph:
    producers = graph.producers()
    users = graph.users()
    types = graph.value_types()

    def sole_producer(value: str, op: str) -> Node | None:
        node = producers.get(value)
        if node is None or node.op != op or sole_reader(graph, users, value) is None:
            return None
        return node

    replaced: dict[int, Node] = {}
    absorbed: set[int] = set()
    for attention in graph.nodes:
        if attention.op != "paged_attention":
            continue
        store = producers.get(attention.inputs[1])
        q_rope = sole_producer(attention.inputs[0], "rope")
        if store is None or store.op != "kv_store" or q_rope is None or store.outputs != attention.inputs[1:3]:
            continue
        k_rope = sole_producer(store.inputs[2], "rope")
        if k_rope is None or k_rope.inputs[1:] != q_rope.inputs[1:]:
            continue
        q_in, k_in = q_rope.inputs[0], k_rope.inputs[0]
        norms = (sole_producer(q_in, "rmsnorm"), sole_producer(k_in, "rmsnorm"))
        parts = [q_rope, k_rope, store]
        extra: list[str] = []
        attrs = {}
        if all(norms) and norms[0].attrs["eps"] == norms[1].attrs["eps"]:
            q_in, k_in = norms[0].inputs[0], norms[1].inputs[0]
            extra = [norms[0].inputs[1], norms[1].inputs[1]]
            attrs = {"eps": norms[0].attrs["eps"]}
            parts += list(norms)
        positions, cos_sin = q_rope.inputs[1:]
        inputs = [q_in, k_in, store.inputs[3], positions, cos_sin, store.inputs[0], store.inputs[1], store.inputs[4],
                  *extra]
        fused = make_node("rope_kv_store", inputs, [q_rope.out, *store.outputs], [types[i] for i in inputs], attrs)
        replaced[id(store)] = fused
        absorbed.update(id(p) for p in parts if p is not store)
    return rewrite_nodes(graph, replaced, absorbed)
