"""Folding the gated activation into the down GEMM that reads it.

Before:  %g, %u = split(%gu) {sizes=[I, I]}; %m = silu_mul(%g, %u); %d = linear_residual(%m, @w, %r)
After:   %d = silu_mul_linear_residual(%gu, @w, %r)       (where the linear_residual was)

Only when %g, %u and %m have that one reader each and are not graph outputs. Runs after
``fuse_gate_up``/``fuse_silu_mul`` (which make the split and silu_mul) and ``fuse_linear_residual``,
and before ``fuse_norm_linear``, which then finds the gate/up GEMM read by this op alone and folds the
norm before it. The activation goes with the down GEMM rather than with the gate/up one because
the down GEMM is the one that stays a GEMV at decode: at Llama-3-8B's sizes the gate/up weight is
left to cuBLAS, and an activation fused there would be a kernel of its own again.
"""

from __future__ import annotations

from kiln.ir import Graph, Node, make_node

from .base import PassContext, rewrite_nodes, sole_reader


def fuse_silu_mul_linear(graph: Graph, ctx: PassContext) -> Graph:
    users = graph.users()
    producers = graph.producers()
    types = graph.value_types()
    replaced: dict[int, Node] = {}
    absorbed: set[int] = set()
    for down in graph.nodes:
        if down.op != "linear_residual":
            continue
        silu_mul = producers.get(down.inputs[0])
        if silu_mul is None or silu_mul.op != "silu_mul" or sole_reader(graph, users, silu_mul.out) is not down:
            continue
        split = producers.get(silu_mul.inputs[0])
        if split is None or split.op != "split" or list(split.outputs) != list(silu_mul.inputs):
            continue
        if any(sole_reader(graph, users, half) is not silu_mul for half in split.outputs):
            continue
        gate_up, weight, residual = split.inputs[0], down.inputs[1], down.inputs[2]
        absorbed.update((id(split), id(silu_mul)))
        replaced[id(down)] = make_node("silu_mul_linear_residual", [gate_up, weight, residual], [down.out],
                                       [types[gate_up], types[weight], types[residual]])
    return rewrite_nodes(graph, replaced, absorbed)
