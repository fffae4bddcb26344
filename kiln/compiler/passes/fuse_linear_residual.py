"""Folding each residual add into the GEMM that produces its summand.

Before:  %o = linear(%x, @w); %h = add(%r, %o)
After:   %h = linear_residual(%x, @w, %r)       (placed where the add was; %o had no other reader)

Done before the norms are fused: with the add gone, the RMSNorm that read the sum reads this GEMM's
output and can join the GEMM after it (``fuse_norm_linear``). Linears with a bias are left alone.
"""

from __future__ import annotations

from kiln.ir import Graph, Node, make_node

from .base import PassContext, fold_operand_producers


def fuse_linear_residual(graph: Graph, ctx: PassContext) -> Graph:
    types = graph.value_types()

    def fold(add: Node, linear: Node, residual: str) -> Node | None:
        if len(linear.inputs) != 2 or types[residual] != types[linear.out]:
            return None
        x, weight = linear.inputs
        return make_node("linear_residual", [x, weight, residual], [add.out], [types[x], types[weight], types[residual]])

    # Models write the residual stream first (h + o), so the GEMM is looked for on the right first.
    return fold_operand_producers(graph, "add", "linear", (1, 0), fold)
