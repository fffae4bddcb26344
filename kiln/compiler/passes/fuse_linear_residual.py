"""Folding each residual add into the GEMM that produces its summand.

Before:  %o = linear(%x, @w); %h = add(%r, %o)
After:   %h = linear_residual(%x, @w, %r)       (placed where the add was; %o had no other reader)

Done before the norms are fused: with the add gone, the RMSNorm that read the sum reads this GEMM's
output and can join the GEMM after it (``fuse_norm_linear``). Linears with a bias are left alone.
"""

from __future__ import annotations

from kiln.ir import Graph, Node

from .base import PassContext
from .patterns import Match, Rule, op, rewrite, var


def _build(m: Match) -> Node | None:
    gemm = m.nodes["gemm"]
    if m.type(m["residual"]) != gemm.type:
        return None
    return m.make("linear_residual", [m["x"], m["weight"], m["residual"]], [m.root.out])


def _gemm_on(side: int) -> Rule:
    gemm = op("linear", var("x"), var("weight"), name="gemm")  # two inputs: no bias
    operands = (var("residual"), gemm) if side == 1 else (gemm, var("residual"))
    return Rule(op("add", *operands), _build)


# Models write the residual stream first (h + o), so the GEMM is looked for on the right first.
RESIDUAL_INTO_GEMM = (_gemm_on(1), _gemm_on(0))


def fuse_linear_residual(graph: Graph, ctx: PassContext) -> Graph:
    return rewrite(graph, ctx, *RESIDUAL_INTO_GEMM)
