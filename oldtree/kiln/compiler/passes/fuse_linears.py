"""Fusing sibling linears (several linears reading one input) into one GEMM followed by a split.

Matched by structure, not by weight names: an attention layer's q/k/v projections and an MLP's
gate/up projections are such siblings, and so is any group a new model makes. Linears join when
their weights are parameters no other node reads, of one dtype, format (plain, or one quantization
scheme, whose scales then join too) and placement, and all or none have a bias. The fused weight is
the row-wise concatenation of the members' (a ``Concat`` recipe); its name joins theirs; the split's
outputs keep the members' value names, so nothing downstream changes. Column-parallel shards
(``shard_tp``) join the same way: each rank's fused weight is the concatenation of its shards, and
so its own column shard of the fused GEMM.

Before:  %q = linear(%x, @a.q_proj.weight); %k = linear(%x, @a.k_proj.weight); %v = linear(%x, @a.v_proj.weight)
After:   %q_k_v = linear(%x, @a.q_k_v_proj.weight); %q, %k, %v = split(%q_k_v) {sizes=[…]}
"""

from __future__ import annotations

import re
from typing import Hashable, Sequence

from kiln.ir import Graph, Param, WeightFormat, make_node

from ..recipes import Concat
from .base import PassContext
from .patterns import Match, Replacement, op, rewrite_siblings, var

SIBLING = op("linear", var("x"), var("weight"), var("bias", optional=True))


def fuse_linears(graph: Graph, ctx: PassContext) -> Graph:
    users = graph.users()
    taken = set(graph.value_types())

    def key(m: Match) -> Hashable | None:
        names = [m[role] for role in ("weight", "bias") if m[role] is not None]
        params = [graph.params.get(name) for name in names]
        if any(p is None or p.placement != params[0].placement or len(users[p.name]) != 1 for p in params):
            return None
        weight = params[0]
        return m["x"], len(params), weight.type.dtype, weight.format.scheme, weight.placement

    def concat(parts: list[Param]) -> tuple[list[Param], list[Concat]]:
        """``parts`` joined row-wise: the new parameter, then its scales, and the recipes making them."""
        first = parts[0]
        scales: list[Param] = []
        recipes: list[Concat] = []
        for index in range(len(first.format.scales)):
            (scale,), (recipe,) = concat([graph.params[p.format.scales[index]] for p in parts])
            scales.append(scale)
            recipes.append(recipe)
        name = joined_name([p.name for p in parts], taken)
        rows = sum(p.type.shape[0] for p in parts)
        fused = Param(name, first.type.with_shape((rows, *first.type.shape[1:])),
                      WeightFormat(first.format.scheme, tuple(s.name for s in scales)), first.placement)
        return [fused, *scales], [Concat(name, tuple(p.name for p in parts)), *recipes]

    def build(members: list[Match]) -> Replacement:
        x = members[0]["x"]
        inputs, params, recipes = [x], [], []
        for role in ("weight", "bias"):
            if members[0][role] is not None:
                made, made_recipes = concat([graph.params[m[role]] for m in members])
                inputs.append(made[0].name)
                params += made
                recipes += made_recipes
        types = {p.name: p.value_type for p in params} | {x: members[0].type(x)}
        fused = joined_name([m.root.out for m in members], taken)
        gemm = make_node("linear", inputs, [fused], [types[i] for i in inputs])
        split = make_node("split", [fused], [m.root.out for m in members], [gemm.type],
                          {"sizes": [m.root.type.shape[1] for m in members]})
        return Replacement((gemm, split), tuple(params), tuple(recipes))

    return rewrite_siblings(graph, ctx, SIBLING, key, build)


def joined_name(names: Sequence[str], taken: set[str]) -> str:
    """A name for the fusion of ``names``: the words (between ``.`` and ``_``) they share at the start
    and the end, around their differing middles joined by ``_`` (``a.q_proj.weight`` and
    ``a.k_proj.weight`` give ``a.q_k_proj.weight``); numbered if ``taken`` holds it; added to ``taken``."""
    words = [re.split(r"([._])", name) for name in names]
    shortest = min(len(w) for w in words)
    head = 0
    while head < shortest and all(w[head] == words[0][head] for w in words):
        head += 1
    tail = 0
    while tail < shortest - head and all(w[-1 - tail] == words[0][-1 - tail] for w in words):
        tail += 1
    middles = ["".join(w[head:len(w) - tail]) for w in words]
    joined = "".join(words[0][:head]) + "_".join(middles) + "".join(words[0][len(words[0]) - tail:])
    name, number = joined, 1
    while name in taken:
        name, number = f"{joined}.{number}", number + 1
    taken.add(name)
    return name
