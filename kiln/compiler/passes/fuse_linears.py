"""Fusing sibling linears (one input, several weights) into one GEMM followed by a split.

``fuse_qkv`` merges each attention layer's q/k/v projections; ``fuse_gate_up`` each MLP's gate and
up projections. The fused weight (and bias) is the row-wise concatenation of the originals; the
split's outputs keep the original value names, so nothing downstream changes.

Before:  %q = linear(%x, @…q_proj.weight); %k = linear(%x, @…k_proj.weight); %v = linear(%x, @…v_proj.weight)
After:   %qkv = linear(%x, @…qkv_proj.weight); %q, %k, %v = split(%qkv) {sizes=[…]}
"""

from __future__ import annotations

from kiln.ir import Graph, Node, Param, make_node

from ..recipes import Concat
from .base import PassContext


def fuse_qkv(graph: Graph, ctx: PassContext) -> Graph:
    return fuse_sibling_linears(graph, ctx, ("q_proj", "k_proj", "v_proj"), "qkv_proj")


def fuse_gate_up(graph: Graph, ctx: PassContext) -> Graph:
    return fuse_sibling_linears(graph, ctx, ("gate_proj", "up_proj"), "gate_up_proj")


def fuse_sibling_linears(graph: Graph, ctx: PassContext, roles: tuple[str, ...], fused_role: str) -> Graph:
    """Fuses every group of linears reading the same input whose weights are ``<prefix>.<role>.weight``
    for each of ``roles`` (in that order), with biases on all or none."""
    groups = _find_groups(graph, roles)
    if not groups:
        return graph
    params = dict(graph.params)
    first_of_group = {id(group[0]): group for group in groups}
    dropped = {id(node) for group in groups for node in group[1:]}
    nodes: list[Node] = []
    for node in graph.nodes:
        if id(node) in dropped:
            continue
        group = first_of_group.get(id(node))
        if group is None:
            nodes.append(node)
            continue
        nodes.extend(_fuse_group(graph, ctx, params, group, roles, fused_role))
    return graph.replace(nodes=nodes, params=params)


def _find_groups(graph: Graph, roles: tuple[str, ...]) -> list[list[Node]]:
    users = graph.users()
    by_prefix_and_input: dict[tuple[str, str], dict[str, Node]] = {}
    for node in graph.nodes:
        if node.op != "linear":
            continue
        weight = node.inputs[1]
        parts = weight.rsplit(".", 2)
        if len(parts) != 3 or parts[1] not in roles or parts[2] != "weight" or len(users.get(weight, [])) != 1:
            continue
        by_prefix_and_input.setdefault((parts[0], node.inputs[0]), {})[parts[1]] = node
    groups = []
    for found in by_prefix_and_input.values():
        if set(found) == set(roles) and len({len(n.inputs) for n in found.values()}) == 1:
            groups.append([found[role] for role in roles])
    return groups


def _fuse_group(graph: Graph, ctx: PassContext, params: dict[str, Param], group: list[Node],
                roles: tuple[str, ...], fused_role: str) -> list[Node]:
    x = group[0].inputs[0]
    prefix = group[0].inputs[1].rsplit(".", 2)[0]
    sizes = [node.type.shape[1] for node in group]
    fused_inputs = [x]
    for kind, index in (("weight", 1), ("bias", 2)):
        if len(group[0].inputs) <= index:
            continue
        originals = [params[node.inputs[index]] for node in group]
        name = f"{prefix}.{fused_role}.{kind}"
        rows = sum(p.type.shape[0] for p in originals)
        params[name] = Param(name, originals[0].type.with_shape((rows,) + originals[0].type.shape[1:]))
        ctx.add_recipe(Concat(name, tuple(p.name for p in originals), axis=0))
        fused_inputs.append(name)
    types = graph.value_types()
    types.update((name, params[name].type) for name in fused_inputs[1:])
    fused_name = f"{group[0].out}.{fused_role}"
    fused = make_node("linear", fused_inputs, [fused_name], [types[i] for i in fused_inputs])
    split = make_node("split", [fused_name], [node.out for node in group], [fused.type], {"sizes": sizes})
    return [fused, split]
