"""Folding each residual add into the GEMM that produces its summand.

Before:  %o = linear(%x, @w); %h = add(%r, %o)
After:   %h = linear_residual(%x, @w, %r)       (placed where the add was; %o had no other reader)

Done before the norms are fused: with the add gone, the RMSNorm that read the sum reads this GEMM's
output and can join the GEMM after it (``fuse_norm_linear``). Linears with a bias are left alone.
"""

from __future__ import annotations

from kiln.ir import Graph, make_node

from .base import PassContext, rewrite_nodes, sole_reader


def fuse_linear_residual(graph: Graph, ctx: PassContext) -> Graph:
    producers = graph.producers()
    users = graph.users()
    types = graph.value_types()
    replaced: dict[int, object] = {}
    absorbed: set[int] = set()
    for node in graph.nodes:
        if node.op != "add":
            continue
        for gemm_side, other in ((1, 0), (0, 1)):
            linear = producers.get(node.inputs[gemm_side])
            residual = node.inputs[other]
            if (linear is None or linear.op != "linear" or len(linear.inputs) != 2 or id(linear) in absorbed
                    or sole_reader(graph, users, linear.out) is None
                    or types[residual] != types[linear.out]):
                continue
            x, weight = linear.inputs
            replaced[id(node)] = make_node("linear_residual", [x, weight, residual], [node.out],
                                           [types[x], types[weight], types[residual]])
            absorbed.add(id(linear))
            break
    return rewrite_nodes(graph, replaced, absorbed)
