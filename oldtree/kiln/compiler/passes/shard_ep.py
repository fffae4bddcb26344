"""Expert parallelism: the routed experts of each ``moe`` partitioned over ``ctx.ep`` ranks.

Each ``moe``'s stacked weights (``[E, 2I, H]`` gate/up, ``[E, H, I]`` down) are cut along the expert
axis into ``ep`` contiguous slices (``@w.shard``, a ``Shard`` of the model's ``Stack``, placement
``expert(0)``); rank r holds experts ``r * E/ep ..`` and reads its first expert from a per-rank
parameter ``@….expert_start`` (an i32[1]: ``Constant`` of every rank's start, ``Shard``ed), which
the ``moe`` op subtracts from the ids. The router stays replicated, so every rank routes every token
alike and computes its experts' share of each token's sum; an ``all_reduce`` adds the shares:

Before:  %l0.experts = moe(%l0.mlp_in, %l0.route_w, %l0.route_ids, @gu, @down) : f32[T, 8]
After:   %l0.experts.part = moe(%l0.mlp_in, %l0.route_w, %l0.route_ids, @gu.shard, @down.shard,
                                @gu.expert_start) : f32[T, 8]
         %l0.experts = all_reduce(%l0.experts.part) {world_size=2} : f32[T, 8]

Dispatch and combine. Every rank already holds every token's hidden state at the MoE block (the
attention before it is replicated, or tensor-parallel and completed by its ``all_reduce``), so
dispatch costs nothing, and the combine is one ``all_reduce`` of ``[T, H]`` (which NCCL runs as a
reduce-scatter plus an all-gather: the all-gather + reduce-scatter scheme, with the gather already
done by the attention's reduction). An all-to-all dispatch pays off only when tokens are spread over
the ranks (data-parallel attention), and its message sizes depend on the routing, which a CUDA graph
cannot capture without padding every message to the worst case; here each rank would have to send
all of its tokens to the k ranks of their experts and back, more bytes than the all-reduce for
top-k >= 2 at these rank counts, so kiln does not use one.

Ranks. Expert parallelism lives inside tensor parallelism, as in SGLang (``--tp N --ep M``: its
``moe_tp_size = tp / ep``) and vLLM (``--enable-expert-parallel``): the program runs on
``max(tp, ep)`` ranks. With ``tp`` 1 the attention, the dense MLPs and Qwen2-MoE's shared expert
are replicated on the ``ep`` ranks; with ``tp`` > 1 the ``shard_tp`` pass (which runs first and
leaves ``moe`` alone) has made them tensor-parallel over the ``tp`` ranks, and ``ep`` must divide
``tp``: rank r holds expert group ``r // (tp/ep)`` and, of each of those experts, part
``r % (tp/ep)`` of the intermediate width (gate and up rows, down columns; a ``Shard`` of the
expert slice, ``cyclic``, with ``groups=2`` for the gate/up halves). Every rank's output is still a
part of the sum, so the one ``all_reduce`` over all ranks completes it. ``ep`` above a ``tp`` > 1 is
refused by name. Runs right after ``shard_tp``; with one expert rank it changes nothing.
"""

from __future__ import annotations

from kiln.ir import Graph, Node, Param, TensorType, make_node
from kiln.ir.types import DType
from kiln.ir.weights import Layout, Placement
from kiln.models.moe import ARCHITECTURES as MOE_ARCHITECTURES

from ..recipes import Constant, Shard
from .base import PassContext
from .shard_tp import _divisors, _fresh


def check_ep(ep: int, tp: int) -> None:
    """Refuses an ep/tp mix the pass does not lay out, naming the ones it does."""
    if ep < 1:
        raise ValueError(f"ep must be >= 1, got {ep}")
    if ep > 1 and tp > 1 and tp % ep:
        raise ValueError(f"ep={ep} with tp={tp} is not supported: expert parallelism runs inside tensor "
                         f"parallelism on max(tp, ep) ranks, with tp=1 (attention replicated) or ep dividing tp "
                         f"(attention tensor-parallel over the same ranks, each expert split over tp/ep of them)")


def shard_ep(graph: Graph, ctx: PassContext) -> Graph:
    ep = ctx.ep
    if ep == 1:
        return graph
    check_ep(ep, ctx.tp)
    ranks = max(ctx.tp, ep)
    width_parts = ranks // ep  # each expert's intermediate width split over this many ranks (tp / ep)
    experts = [node for node in graph.nodes if node.op == "moe"]
    if not experts:
        raise ValueError(f"ep={ep}: {graph.name} has no routed experts (no moe op); expert parallelism is for "
                         f"mixture-of-experts models ({', '.join(MOE_ARCHITECTURES)})")
    taken = set(graph.value_types())
    params = dict(graph.params)
    renamed: dict[str, str] = {}
    starts: dict[str, str] = {}  # stacked gate/up weight -> its rank's expert_start parameter
    for node in experts:
        if len(node.inputs) > 5:
            raise ValueError(f"shard_ep: {node.out} is already sharded over experts")
        gate_up = node.inputs[3]
        count = graph.params[gate_up].type.shape[0]
        if count % ep:
            raise ValueError(f"ep={ep} must divide the experts ({count} in {node.out}); possible ep: {_divisors(count)}")
        width = graph.params[node.inputs[4]].type.shape[2]
        if width % width_parts:
            raise ValueError(f"tp={ctx.tp} / ep={ep} = {width_parts} must divide the experts' intermediate size "
                             f"({width} in {node.out})")
        for name, axis, groups in ((gate_up, 1, 2), (node.inputs[4], 2, 1)):
            if name not in renamed:
                renamed[name] = _expert_shard(name, ep, ranks, axis, groups, params, taken, ctx)
        if gate_up not in starts:
            starts[gate_up] = _expert_start(gate_up, count, ep, ranks, params, taken, ctx)
    types: dict[str, TensorType] = {**graph.inputs, **{name: p.value_type for name, p in params.items()}}
    nodes: list[Node] = []
    for node in graph.nodes:
        if node.op != "moe":
            nodes.append(node)
            types.update(zip(node.outputs, node.types))
            continue
        args = [renamed.get(i, i) for i in node.inputs] + [starts[node.inputs[3]]]
        part = _fresh(f"{node.out}.part", taken)
        nodes.append(make_node("moe", args, [part], [types[a] for a in args], dict(node.attrs)))
        nodes.append(make_node("all_reduce", [part], node.outputs, [node.type], {"world_size": ranks}))
        types.update(zip(node.outputs, node.types))
        types[part] = node.type
    kept = {name: p for name, p in params.items() if name not in renamed}
    return graph.replace(params=kept, nodes=nodes)


def _expert_shard(name: str, ep: int, ranks: int, width_axis: int, groups: int, params: dict[str, Param],
                  taken: set[str], ctx: PassContext) -> str:
    """The rank's experts of a stacked weight; with more ranks than ep, its part of their width too."""
    param = params[name]
    shape = list(param.type.shape)
    shape[0] //= ep
    sharded = _fresh(f"{name}.shard", taken)
    width_parts = ranks // ep
    if width_parts == 1:
        ctx.add_recipe(Shard(sharded, name, 0, ep, ranks))
    else:
        experts = _fresh(f"{name}.experts", taken)
        ctx.add_recipe(Shard(experts, name, 0, ep, ranks))  # rank r: group r // width_parts
        ctx.add_recipe(Shard(sharded, experts, width_axis, width_parts, ranks, cyclic=True, groups=groups))
        shape[width_axis] //= width_parts
    params[sharded] = Param(sharded, param.type.with_shape(tuple(shape)), param.format, Placement(Layout.expert, 0))
    return sharded


def _expert_start(gate_up: str, count: int, ep: int, ranks: int, params: dict[str, Param], taken: set[str],
                  ctx: PassContext) -> str:
    """The parameter holding the rank's first expert: its part of every slice's start."""
    every = _fresh(f"{gate_up}.expert_starts", taken)
    name = _fresh(f"{gate_up}.expert_start", taken)
    ctx.add_recipe(Constant(every, tuple(part * count // ep for part in range(ep))))
    ctx.add_recipe(Shard(name, every, 0, ep, ranks))  # rank r: its group's, r // (ranks / ep)
    params[name] = Param(name, TensorType((1,), DType.i32), placement=Placement(Layout.expert, 0))
    return name
