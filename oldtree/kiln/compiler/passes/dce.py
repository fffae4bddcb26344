"""Dead-code elimination: drops nodes whose outputs nothing reads (unless the op has an effect)
and parameters no node reads (a live quantized weight keeps its scales). Graph inputs stay: they
are the step's interface."""

from __future__ import annotations

from kiln.ir import Graph, get_op

from .base import PassContext


def eliminate_dead_code(graph: Graph, ctx: PassContext) -> Graph:
    live = set(graph.outputs)
    kept = []
    for node in reversed(graph.nodes):
        if get_op(node.op).has_effect or live.intersection(node.outputs):
            kept.append(node)
            live.update(node.inputs)
    kept.reverse()
    live.update(scale for name in live.intersection(graph.params) for scale in graph.params[name].format.scales)
    params = {name: p for name, p in graph.params.items() if name in live}
    if len(kept) == len(graph.nodes) and len(params) == len(graph.params):
        return graph
    return graph.replace(nodes=kept, params=params)
