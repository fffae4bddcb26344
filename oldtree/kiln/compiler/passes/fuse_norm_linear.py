"""Folding each RMSNorm into the GEMM that reads it.

Before:  %n = rmsnorm(%x, @g) {eps}; %y = linear(%n, @w)
After:   %y = rmsnorm_linear(%x, @g, @w) {eps}                       (where the linear was)

Only when the norm's output has that one reader and is not a graph output. Runs after
``fuse_linear_residual`` (which leaves the norms reading GEMM outputs instead of adds).
"""

from __future__ import annotations

from kiln.ir import Graph, Node

from .base import PassContext
from .patterns import Match, Rule, op, rewrite, var


def _build(m: Match) -> Node:
    return m.make("rmsnorm_linear", [m["x"], m["norm_weight"], m["weight"], m["bias"]], [m.root.out],
                  m.nodes["norm"].attrs)


NORM_INTO_GEMM = Rule(
    op("linear", op("rmsnorm", var("x"), var("norm_weight"), name="norm"), var("weight"), var("bias", optional=True)),
    _build)


def fuse_norm_linear(graph: Graph, ctx: PassContext) -> Graph:
    return rewrite(graph, ctx, NORM_INTO_GEMM)
