"""Folding the gated activation into the down GEMM that reads it.

Before:  %g, %u = split(%gu) {sizes=[I, I]}; %m = silu_mul(%g, %u); %d = linear_residual(%m, @w, %r)
After:   %d = silu_mul_linear_residual(%gu, @w, %r)       (where the linear_residual was)

Only when %g, %u and %m have that one reader each and are not graph outputs. Runs after
``fuse_linears``/``fuse_silu_mul`` (which make the split and silu_mul) and ``fuse_linear_residual``,
and before ``fuse_norm_linear``, which then finds the gate/up GEMM read by this op alone and folds the
norm before it. The activation goes with the down GEMM rather than with the gate/up one because
the down GEMM is the one that stays a GEMV at decode: at Llama-3-8B's sizes the gate/up weight is
left to cuBLAS, and an activation fused there would be a kernel of its own again.
"""

from __future__ import annotations

from kiln.ir import Graph, Node

from .base import PassContext
from .patterns import Match, Rule, op, rewrite, var


def _build(m: Match) -> Node | None:
    if len(m.nodes["split"].outputs) != 2:
        return None
    return m.make("silu_mul_linear_residual", [m["gate_up"], m["weight"], m["residual"]], [m.root.out])


_HALVES = (op("split", var("gate_up"), name="split", output=0), op("split", name="split", output=1))
ACTIVATION_INTO_GEMM = Rule(op("linear_residual", op("silu_mul", *_HALVES), var("weight"), var("residual")), _build)


def fuse_silu_mul_linear(graph: Graph, ctx: PassContext) -> Graph:
    return rewrite(graph, ctx, ACTIVATION_INTO_GEMM)
