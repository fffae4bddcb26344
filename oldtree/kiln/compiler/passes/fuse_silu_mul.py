"""Fusing the gated-MLP activation: ``mul(silu(g), u)`` becomes ``silu_mul(g, u)``.

Before:  %a = silu(%g); %m = mul(%a, %u)
After:   %m = silu_mul(%g, %u)          (when %a has no other reader)
"""

from __future__ import annotations

from kiln.ir import Graph, Node

from .base import PassContext
from .patterns import Match, Rule, op, rewrite, var


def _build(m: Match) -> Node:
    return m.make("silu_mul", [m["gate"], m["up"]], [m.root.out])


_SILU = op("silu", var("gate"))
SILU_MUL = (Rule(op("mul", _SILU, var("up")), _build), Rule(op("mul", var("up"), _SILU), _build))


def fuse_silu_mul(graph: Graph, ctx: PassContext) -> Graph:
    return rewrite(graph, ctx, *SILU_MUL)
