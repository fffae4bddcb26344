"""Fusing each residual add with the RMSNorm that reads its sum.

Before:  %s = add(%a, %b); %y = rmsnorm(%s, @w) {eps=…}
After:   %y, %s = add_rmsnorm(%a, %b, @w) {eps=…}     (placed where the add was)

The sum stays an output, so other readers of ``%s`` (the next residual add) are unchanged.
"""

from __future__ import annotations

from kiln.ir import Graph, make_node

from .base import PassContext, rewrite_nodes


def fuse_add_rmsnorm(graph: Graph, ctx: PassContext) -> Graph:
    producers = graph.producers()
    types = graph.value_types()
    fused_at: dict[int, object] = {}
    absorbed: set[int] = set()
    for node in graph.nodes:
        if node.op != "rmsnorm":
            continue
        add = producers.get(node.inputs[0])
        if add is None or add.op != "add" or id(add) in fused_at:
            continue
        a, b = add.inputs
        weight = node.inputs[1]
        fused_at[id(add)] = make_node("add_rmsnorm", [a, b, weight], [node.out, add.out],
                                      [types[a], types[b], types[weight]], dict(node.attrs))
        absorbed.add(id(node))
    return rewrite_nodes(graph, fused_at, absorbed)
