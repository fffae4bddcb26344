"""Expert-load visibility: each sparse layer counts the tokens its router sends to each expert.

After every ``router_topk`` the pass adds a ``count_experts`` over its ids into a new graph input,
``expert_load.{layer}`` (i64 ``[E]``), a state the runtime keeps across steps as it keeps the KV pool:

Before:  %l1.route_w, %l1.route_ids = router_topk(%l1.router) {top_k=2} : f32[T, 2], i32[T, 2]
After:   %l1.route_w, %l1.route_ids = router_topk(%l1.router) {top_k=2} : f32[T, 2], i32[T, 2]
         %expert_load.1.counted = count_experts(%expert_load.1, %l1.route_ids, %slots) : i64[8]

Rows whose slot is -1 (the padding of graph buckets) count nothing. ``layer`` is the decoder layer
(the number of attentions before the router, less one), found by structure, so a model whose first
layers are dense (Qwen2-MoE's ``mlp_only_layers``) labels its sparse layers by their own index. The
router is replicated under expert parallelism, so every rank counts every token; the runtime reads
rank 0's. The cost is a few atomic adds a row in the router's launch (``fuse_router_count`` joins the
two ops); nothing is read back to the host until someone asks (``/metrics``, ``kiln bench``). Runs
after sharding, before the fusions, and changes nothing in a model without experts.
"""

from __future__ import annotations

from kiln.ir import Graph, Node, TensorType, make_node
from kiln.ir.types import DType

from .base import PassContext

PREFIX = "expert_load."


def router_layers(graph: Graph) -> dict[int, int]:
    """Each ``router_topk`` node (by id) mapped to its decoder layer: the attentions before it, less one."""
    layers, attentions = {}, 0
    for node in graph.nodes:
        if node.op in ("paged_attention", "rope_kv_attention"):
            attentions += 1
        elif node.op == "router_topk":
            layers[id(node)] = attentions - 1
    return layers


def count_expert_load(graph: Graph, ctx: PassContext) -> Graph:
    layers = router_layers(graph)
    # A pipelined artifact's stages would each count their own layers, which the manifest's one list
    # of counters (stage 0's) does not describe: its expert load is not counted yet.
    if not layers or ctx.pp > 1:
        return graph
    types = graph.value_types()
    inputs = dict(graph.inputs)
    nodes: list[Node] = []
    for node in graph.nodes:
        nodes.append(node)
        if node.op != "router_topk":
            continue
        counts = f"{PREFIX}{layers[id(node)]}"
        if counts in inputs:
            raise ValueError(f"count_expert_load: layer {layers[id(node)]} has two routers ({node.outputs[1]})")
        inputs[counts] = TensorType((types[node.inputs[0]].shape[1],), DType.i64)  # the router's experts
        args = [counts, node.outputs[1], "slots"]
        nodes.append(make_node("count_experts", args, [f"{counts}.counted"],
                               [inputs[counts], types[node.outputs[1]], types["slots"]], {}))
    return graph.replace(inputs=inputs, nodes=nodes)
