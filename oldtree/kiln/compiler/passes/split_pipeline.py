"""Pipeline parallelism: keeps pipeline stage ``ctx.stage`` of ``ctx.pp`` (its decoder layers, their
weights and KV caches), receiving the hidden state from the stage before and sending its own on.

The compiler runs the pass list once per stage (``compile.compile_model``); each run keeps one
stage, so every stage is its own graph, fused, planned and generated on its own, and the ranks of a
stage run its program. The L decoder layers (L: the attentions) split evenly, the first ``L % pp``
stages holding one more (``stage_layers``, the split the planner sizes stages by). A cut between stages is found by structure, not by names: the last place in the
node order where that many attentions lie before and exactly one computed value (the residual
stream) is read after; the stage before ends by ``send``-ing it to the next stage, which begins
by ``recv``-ing it (peers are stage numbers in the ``pp`` group: the ranks holding the same tensor
shard in every stage). The last stage computes the logits, which the runtime returns to stage 0
(``runtime/worker/pipeline_runner.py``: the scheduler's rank samples them). Collectives already in the graph (``shard_tp``'s) run within the
stage: they get ``group="tp"``. Each stage keeps the step's inputs, its layers' KV caches and the
parameters its nodes read (a tied embedding is held by the first and the last stage).

Before (pp=2, stage 1; stage 0 ends with ``%l0.resid_mlp.sent = send(%l0.resid_mlp) {group="pp", peer=1}``):
         %l0.resid_mlp = add(%l0.resid_attn, %l0.down) : f32[T, 8]
         %l1.attn_in = rmsnorm(%l0.resid_mlp, @l1.input_layernorm.weight) {eps=1e-06} : f32[T, 8]
After:   %l0.resid_mlp = recv() {dtype="f32", group="pp", peer=0, shape=["T", 8]} : f32[T, 8]
         %l1.attn_in = rmsnorm(%l0.resid_mlp, @l1.input_layernorm.weight) {eps=1e-06} : f32[T, 8]

Runs right after ``shard_tp`` (which shards the whole model alike on every stage), before the
fusions, which then never join ops of two stages. With one stage it changes nothing.
"""

from __future__ import annotations

from kiln.ir import Graph, Node, make_node

from .base import PassContext

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """The decoder layers stage ``stage`` of ``pp`` holds: an even split, the first stages one more."""
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def split_pipeline(graph: Graph, ctx: PassContext) -> Graph:
    pp, stage = ctx.pp, ctx.stage
    if pp == 1:
        return graph
    num_layers = sum(node.op == "paged_attention" for node in graph.nodes)
    if not 0 <= stage < pp:
        raise ValueError(f"split_pipeline: stage {stage} is not one of the {pp} stages")
    if pp > num_layers:
        raise ValueError(f"pp={pp}: the model has {num_layers} decoder layers, fewer than the stages; "
                         f"pp may be at most {num_layers}")
    cuts = _cuts(graph, [stage_layers(num_layers, pp, s).start for s in range(1, pp)])
    begin, end = ([0, *cuts, len(graph.nodes)][stage:stage + 2])
    types = graph.value_types()
    nodes: list[Node] = []
    if stage > 0:
        received = _crossing(graph, begin)
        t = types[received]
        nodes.append(make_node("recv", [], [received], [], {"shape": list(t.shape), "dtype": t.dtype.value,
                                                          "peer": stage - 1, "group": "pp"}))
    for node in graph.nodes[begin:end]:
        if node.op in COLLECTIVES:
            node = make_node(node.op, node.inputs, node.outputs, [types[i] for i in node.inputs],
                             {**node.attrs, "group": "tp"})
        nodes.append(node)
    outputs = graph.outputs
    if stage < pp - 1:
        sent = _crossing(graph, end)
        outputs = (f"{sent}.sent",)
        nodes.append(make_node("send", [sent], list(outputs), [types[sent]], {"peer": stage + 1, "group": "pp"}))
    read = {name for node in nodes for name in node.inputs}
    caches = {name for node in graph.nodes if node.op == "kv_store" for name in node.inputs[:2]}
    inputs = {name: t for name, t in graph.inputs.items() if name in read or name not in caches}
    params = {name: p for name, p in graph.params.items() if name in read}
    return graph.replace(inputs=inputs, params=params, nodes=nodes, outputs=outputs)


def _cuts(graph: Graph, layer_starts: list[int]) -> list[int]:
    """For each layer start, the node index where a stage starting at that layer begins."""
    cuts = []
    for layer in layer_starts:
        candidates = [p for p, attentions in _attentions_before(graph) if attentions == layer
                      and len(_crossing_values(graph, p)) == 1]
        if not candidates:
            raise ValueError(f"split_pipeline: no single value crosses into layer {layer}; the graph has no "
                             f"residual stream to cut")
        cuts.append(candidates[-1])
    return cuts


def _attentions_before(graph: Graph) -> list[tuple[int, int]]:
    """(node index, how many attentions come before it), for every index."""
    seen, positions = 0, []
    for index, node in enumerate(graph.nodes):
        positions.append((index, seen))
        seen += node.op == "paged_attention"
    return positions


def _crossing_values(graph: Graph, position: int) -> set[str]:
    """The computed values made before node ``position`` and read at or after it (or returned)."""
    made = {out for node in graph.nodes[:position] for out in node.outputs}
    read = {name for node in graph.nodes[position:] for name in node.inputs} | set(graph.outputs)
    return made & read


def _crossing(graph: Graph, position: int) -> str:
    (value,) = _crossing_values(graph, position)
    return value
