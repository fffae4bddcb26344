"""Redundant experts: each sparse layer named in ``ctx.expert_placement`` gets its experts' weights
stacked in slot order (a copy per slot; ``compiler/expert_placement.py`` says how slots are chosen)
and a ``place_experts`` before its ``moe`` that sends each choice to one copy of its expert:

Before:  %l0.experts = moe(%x, %l0.route_w, %l0.route_ids, @gu, @down) : f32[T, 8]
After:   %l0.route_ids.placed = place_experts(%l0.route_ids, @gu.placement) : i32[T, 2]
         %l0.experts = moe(%x, %l0.route_w, %l0.route_ids.placed, @gu.placed, @down.placed) : f32[T, 8]
         param @gu.placed: f32[S, 12, 8]            (a Stack of the model's per-expert weights, by slot)
         param @gu.placement: i32[E, C]             (expert e's slots, repeated to C columns)

A token picks the copy by its row (row t takes column t % C), so a replicated expert's tokens spread
evenly over its copies whatever the batch. The router, and so the expert-load counters, still see
logical experts. Runs before ``shard_ep``, which then slices the slots over the ranks; with no
placement it changes nothing.
"""

from __future__ import annotations

from kiln.ir import Graph, Node, Param, TensorType, make_node
from kiln.ir.types import DType

from ..recipes import Constant, Stack, recipes_by_output
from .base import PassContext
from .count_expert_load import router_layers
from .shard_tp import _fresh


def place_experts(graph: Graph, ctx: PassContext) -> Graph:
    wanted = dict(ctx.expert_placement)
    if not wanted:
        return graph
    layers = router_layers(graph)
    producers = graph.producers()
    stacks = recipes_by_output(ctx.recipes)
    taken = set(graph.value_types())
    params = dict(graph.params)
    types = graph.value_types()
    nodes: list[Node] = []
    for node in graph.nodes:
        layer = layers.get(id(producers.get(node.inputs[2]))) if node.op == "moe" else None
        if layer not in wanted:
            nodes.append(node)
            continue
        placement = wanted.pop(layer)
        x, weights, ids, gate_up, down = node.inputs[:5]
        experts = params[gate_up].type.shape[0]
        _check(placement, experts, layer)
        slots = {e: [s for s, held in enumerate(placement) if held == e] for e in range(experts)}
        columns = max(len(s) for s in slots.values())
        table = _fresh(f"{gate_up}.placement", taken)
        ctx.add_recipe(Constant(table, tuple(tuple(slots[e][c % len(slots[e])] for c in range(columns))
                                             for e in range(experts))))
        params[table] = Param(table, TensorType((experts, columns), DType.i32))
        placed_ids = _fresh(f"{ids}.placed", taken)
        nodes.append(make_node("place_experts", [ids, table], [placed_ids], [types[ids], params[table].value_type], {}))
        types[placed_ids] = types[ids]
        placed = [_placed(name, placement, params, stacks, taken, ctx) for name in (gate_up, down)]
        args = [x, weights, placed_ids, *placed, *node.inputs[5:]]
        nodes.append(make_node("moe", args, list(node.outputs), [params[a].value_type if a in params else types[a] for a in args],
                               dict(node.attrs)))
    if wanted:
        raise ValueError(f"expert_placement names layer(s) {sorted(wanted)} without routed experts; sparse layers: "
                         f"{sorted(set(layers.values()))}")
    return graph.replace(params=params, nodes=nodes)


def _check(placement: tuple[int, ...], experts: int, layer: int) -> None:
    if any(not 0 <= e < experts for e in placement) or set(placement) != set(range(experts)):
        raise ValueError(f"expert_placement of layer {layer}: every one of the {experts} experts must have a slot "
                         f"and slots hold experts 0..{experts - 1}; got {list(placement)}")


def _placed(name: str, placement: tuple[int, ...], params: dict[str, Param], stacks: dict, taken: set[str],
            ctx: PassContext) -> str:
    """The stacked weight ``name`` with a copy of each expert per slot, from the model's ``Stack``."""
    stack = stacks.get(name)
    if not isinstance(stack, Stack):
        raise ValueError(f"place_experts: {name} is not stacked from per-expert weights by the model")
    param = params.pop(name)
    placed = _fresh(f"{name}.placed", taken)
    ctx.add_recipe(Stack(placed, tuple(stack.inputs[e] for e in placement)))
    params[placed] = Param(placed, param.type.with_shape((len(placement), *param.type.shape[1:])), param.format,
                           param.placement)
    return placed
