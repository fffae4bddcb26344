"""Folding each RMSNorm into the GEMM that reads it, and the gated activation after a gate/up GEMM.

Before:  %n = rmsnorm(%x, @g) {eps}; %y = linear(%n, @w)
After:   %y = rmsnorm_linear(%x, @g, @w) {eps}                       (where the linear was)

Before:  %n = rmsnorm(%x, @g) {eps}; %gu = linear(%n, @w); %a, %b = split(%gu) {sizes=[I, I]};
         %m = silu_mul(%a, %b)
After:   %m = rmsnorm_linear_silu_mul(%x, @g, @w) {eps}               (where the silu_mul was)

Only when each intermediate has that one reader and is not a graph output. Runs after
``fuse_gate_up``/``fuse_silu_mul`` (which make the split and silu_mul) and ``fuse_linear_residual``
(which leaves the norms reading GEMM outputs instead of adds).
"""

from __future__ import annotations

from kiln.ir import Graph, Node, make_node

from .base import PassContext, rewrite_nodes, sole_reader


def fuse_norm_linear(graph: Graph, ctx: PassContext) -> Graph:
    users = graph.users()
    types = graph.value_types()

    def only_reader(value: str) -> Node | None:
        return sole_reader(graph, users, value)

    replaced: dict[int, Node] = {}
    absorbed: set[int] = set()
    for norm in graph.nodes:
        if norm.op != "rmsnorm":
            continue
        linear = only_reader(norm.out)
        if linear is None or linear.op != "linear" or linear.inputs[0] != norm.out:
            continue
        x, norm_weight = norm.inputs
        weights = list(linear.inputs[1:])
        activation = _gated_activation(linear, only_reader, types)
        absorbed.add(id(norm))
        if activation is not None:
            split, silu_mul = activation
            absorbed.update((id(linear), id(split)))
            replaced[id(silu_mul)] = make_node("rmsnorm_linear_silu_mul", [x, norm_weight, *weights], [silu_mul.out],
                                               [types[v] for v in (x, norm_weight, *weights)], dict(norm.attrs))
        else:
            replaced[id(linear)] = make_node("rmsnorm_linear", [x, norm_weight, *weights], [linear.out],
                                             [types[v] for v in (x, norm_weight, *weights)], dict(norm.attrs))
    return rewrite_nodes(graph, replaced, absorbed)


def _gated_activation(linear: Node, only_reader, types) -> tuple[Node, Node] | None:
    """The split into equal halves and the silu_mul(first, second) that consume ``linear``, if that
    is all that reads it (and it has no bias)."""
    split = only_reader(linear.out)
    if len(linear.inputs) != 2 or split is None or split.op != "split" or len(split.outputs) != 2:
        return None
    gate, up = split.outputs
    silu_mul = only_reader(gate)
    if (silu_mul is None or silu_mul.op != "silu_mul" or list(silu_mul.inputs) != [gate, up]
            or only_reader(up) is not silu_mul or types[gate] != types[up]):
        return None
    return split, silu_mul
