"""Folding each residual add into the GEMM that produces its summand.

Before:  %o = linear(%x, @w); %h = add(%r, %o)
After:   %h = linear_residual(%x, @w, %r)       (placed where the add was; %o had no other reader)

The routed experts likewise (their down GEMV adds it as it stores):

Before:  %e = moe(%x, %w, %ids, @gu, @d); %h = add(%r, %e)
After:   %h = moe_residual(%x, %w, %ids, @gu, @d, %r)

Done before the norms are fused: with the add gone, the RMSNorm that read the sum reads this GEMM's
output and can join the GEMM after it (``fuse_norm_linear``). Linears with a bias are left alone, and
so is a rank's ``moe`` under expert parallelism (its ``expert_start`` input): its partial sum goes
to the all_reduce, and the residual must be added once.
"""

from __future__ import annotations

from kiln.ir import Graph, Node

from .base import PassContext
from .patterns import Match, Pattern, Rule, op, rewrite, var


def _build(m: Match) -> Node | None:
    gemm = m.nodes["gemm"]
    if m.type(m["residual"]) != gemm.type:
        return None
    if gemm.op == "moe":
        return m.make("moe_residual", [*gemm.inputs, m["residual"]], [m.root.out], gemm.attrs)
    return m.make("linear_residual", [m["x"], m["weight"], m["residual"]], [m.root.out])


def _gemm_on(side: int, gemm: Pattern) -> Rule:
    operands = (var("residual"), gemm) if side == 1 else (gemm, var("residual"))
    return Rule(op("add", *operands), _build)


_LINEAR = op("linear", var("x"), var("weight"), name="gemm")  # two inputs: no bias
_MOE = op("moe", var("x"), var("weights"), var("ids"), var("w_gate_up"), var("w_down"), name="gemm")  # no expert_start

# Models write the residual stream first (h + o), so the GEMM is looked for on the right first.
RESIDUAL_INTO_GEMM = tuple(_gemm_on(side, gemm) for gemm in (_LINEAR, _MOE) for side in (1, 0))


def fuse_linear_residual(graph: Graph, ctx: PassContext) -> Graph:
    return rewrite(graph, ctx, *RESIDUAL_INTO_GEMM)
