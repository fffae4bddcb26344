"""Folding each RMSNorm into the GEMM that reads it.

Before:  %n = rmsnorm(%x, @g) {eps}; %y = linear(%n, @w)
After:   %y = rmsnorm_linear(%x, @g, @w) {eps}                       (where the linear was)

Only when the norm's output has that one reader and is not a graph output. Runs after
``fuse_linear_residual`` (which leaves the norms reading GEMM outputs instead of adds).
"""

from __future__ import annotations

from kiln.ir import Graph, Node, make_node

from .base import PassContext, rewrite_nodes, sole_reader


def fuse_norm_linear(graph: Graph, ctx: PassContext) -> Graph:
    users = graph.users()
    types = graph.value_types()
    replaced: dict[int, Node] = {}
    absorbed: set[int] = set()
    for norm in graph.nodes:
        if norm.op != "rmsnorm":
            continue
        linear = sole_reader(graph, users, norm.out)
        if linear is None or linear.op != "linear" or linear.inputs[0] != norm.out:
            continue
        x, norm_weight = norm.inputs
        weights = list(linear.inputs[1:])
        absorbed.add(id(norm))
        replaced[id(linear)] = make_node("rmsnorm_linear", [x, norm_weight, *weights], [linear.out],
                                         [types[v] for v in (x, norm_weight, *weights)], dict(norm.attrs))
    return rewrite_nodes(graph, replaced, absorbed)
