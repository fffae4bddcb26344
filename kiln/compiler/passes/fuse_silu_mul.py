"""Fusing the gated-MLP activation: ``mul(silu(g), u)`` becomes ``silu_mul(g, u)``.

Before:  %a = silu(%g); %m = mul(%a, %u)
After:   %m = silu_mul(%g, %u)          (when %a has no other reader)
"""

from __future__ import annotations

from kiln.ir import Graph, make_node

from .base import PassContext, rewrite_nodes, sole_reader


def fuse_silu_mul(graph: Graph, ctx: PassContext) -> Graph:
    producers = graph.producers()
    users = graph.users()
    types = graph.value_types()
    replaced: dict[int, object] = {}
    absorbed: set[int] = set()
    for node in graph.nodes:
        if node.op != "mul":
            continue
        for gate_side, other in ((0, 1), (1, 0)):
            silu = producers.get(node.inputs[gate_side])
            if silu is not None and silu.op == "silu" and sole_reader(graph, users, silu.out) is not None:
                gate, up = silu.inputs[0], node.inputs[other]
                replaced[id(node)] = make_node("silu_mul", [gate, up], [node.out], [types[gate], types[up]])
                absorbed.add(id(silu))
                break
    return rewrite_nodes(graph, replaced, absorbed)
