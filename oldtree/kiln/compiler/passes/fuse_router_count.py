"""Fusing a sparse layer's load counter into its router: ``router_topk`` and the ``count_experts``
over its ids become one ``router_topk_count``.

Before:  %w, %ids = router_topk(%logits) {top_k=2}
         %expert_load.1.counted = count_experts(%expert_load.1, %ids, %slots)
After:   %w, %ids, %expert_load.1.counted = router_topk_count(%logits, %expert_load.1, %slots) {top_k=2}

At decode each is one launch on a few hundred bytes, and a sparse layer's routing was already
longer than reading its chosen experts' weights; the fused kernel counts a row's choices right after
picking them (``kernels/moe_routing.py``). Runs after ``count_expert_load`` adds the counters.
"""

from __future__ import annotations

from kiln.ir import Graph, Node, make_node

from .base import PassContext


def fuse_router_count(graph: Graph, ctx: PassContext) -> Graph:
    routers = {node.outputs[1]: node for node in graph.nodes if node.op == "router_topk"}
    # The fused node sits where the router was: the counter and slots must be there already (graph
    # inputs, as count_expert_load makes them).
    counts = [node for node in graph.nodes if node.op == "count_experts" and node.inputs[1] in routers
              and node.inputs[0] in graph.inputs and node.inputs[2] in graph.inputs]
    if not counts:
        return graph
    count_of = {id(routers[count.inputs[1]]): count for count in counts}
    fused = {id(count) for count in counts}
    types = graph.value_types()
    nodes: list[Node] = []
    for node in graph.nodes:
        if id(node) in fused:
            continue  # now part of its router's node
        count = count_of.get(id(node))
        if count is not None:
            inputs = [node.inputs[0], count.inputs[0], count.inputs[2]]
            node = make_node("router_topk_count", inputs, [*node.outputs, count.outputs[0]],
                             [types[i] for i in inputs], node.attrs)
        nodes.append(node)
    return graph.replace(nodes=nodes)
