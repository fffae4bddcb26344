"""Fusing the gated-MLP activation: ``mul(silu(g), u)`` becomes ``silu_mul(g, u)``.

Before:  %a = silu(%g); %m = mul(%a, %u)
After:   %m = silu_mul(%g, %u)          (when %a has no other reader)
"""

from __future__ import annotations

from kiln.ir import Graph, Node, make_node

from .base import PassContext, fold_operand_producers


def fuse_silu_mul(graph: Graph, ctx: PassContext) -> Graph:
    types = graph.value_types()

    def fold(mul: Node, silu: Node, up: str) -> Node:
        gate = silu.inputs[0]
        return make_node("silu_mul", [gate, up], [mul.out], [types[gate], types[up]])

    return fold_operand_producers(graph, "mul", "silu", (0, 1), fold)
