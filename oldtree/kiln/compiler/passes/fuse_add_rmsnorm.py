"""Fusing each residual add with the RMSNorm that reads its sum.

Before:  %s = add(%a, %b); %y = rmsnorm(%s, @w) {eps=…}
After:   %y, %s = add_rmsnorm(%a, %b, @w) {eps=…}     (placed where the add was)

The sum stays an output, so other readers of ``%s`` (the next residual add) are unchanged.
"""

from __future__ import annotations

from kiln.ir import Graph, Node

from .base import PassContext
from .patterns import Match, Rule, op, rewrite, var


def _build(m: Match) -> Node:
    norm, add = m.nodes["norm"], m.nodes["add"]
    return m.make("add_rmsnorm", [m["a"], m["b"], m["weight"]], [norm.out, add.out], norm.attrs)


ADD_INTO_NORM = Rule(
    op("rmsnorm", op("add", var("a"), var("b"), name="add", shared=True), var("weight"), name="norm"),
    _build, at="add")


def fuse_add_rmsnorm(graph: Graph, ctx: PassContext) -> Graph:
    return rewrite(graph, ctx, ADD_INTO_NORM)
