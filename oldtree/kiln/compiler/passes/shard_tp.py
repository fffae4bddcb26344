"""Tensor parallelism: every rank runs the same graph on its shard of the weights (``ctx.tp`` ranks).

Found by structure, not by weight names, in the unfused graph the models build:
- attention (each ``paged_attention``): the linears making q, k and v (followed back through the
  per-head reshape, norm and rope) are column-parallel, each rank computing its heads; q heads split
  evenly (``tp`` must divide them), KV heads too, or, with more ranks than KV heads, each KV head is
  held by ``tp / kv_heads`` neighbouring ranks (rank r's q heads are the ones that share its KV
  head). The KV caches hold the rank's KV heads; the per-head q/k norms stay whole (per head). The
  linear reading the attention's output (o) is row-parallel, followed by an ``all_reduce`` (its bias,
  if any, held whole by rank 0 and as zeros by the others, so the sum adds it once);
- MLP (each ``mul(silu(gate), up)`` of two linears): gate and up column-parallel, the linear reading
  the product (down) row-parallel, followed by an ``all_reduce``;
- the embedding is vocab-parallel: each rank looks up its rows of the vocabulary (zero rows for the
  other ids) and an ``all_reduce`` sums them; the lm_head (the linear the ``logits`` come from; the
  same parameter when tied) is column-parallel over the vocabulary, its logits joined by an
  ``all_gather``, so every rank has all of them.

Each sharded weight ``@w`` becomes ``@w.shard`` (its rank's part, a ``Shard`` recipe; its placement
says which axis), and a value a collective completes keeps its name, the partial one taking ``.part``:

Before:  %l0.o = linear(%l0.attn_flat, @l0.o_proj.weight) : bf16[T, 64]
After:   %l0.o.part = linear(%l0.attn_flat, @l0.o_proj.weight.shard) : bf16[T, 64]
         %l0.o = all_reduce(%l0.o.part) {world_size=2} : bf16[T, 64]
         param @l0.o_proj.weight.shard: bf16[64, 32] placement=row(1)

Runs right after the verify, before the fusions: they then see the sharded linears (and fuse the
column-parallel siblings, whose shards share a placement), and a residual add after an
``all_reduce`` is not folded into the GEMM before it. With one rank it changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.ir import Graph, Node, Param, TensorType, make_node
from kiln.ir.types import DType
from kiln.ir.weights import Layout, Placement

from ..recipes import Constant, FirstRank, Shard
from .base import PassContext
from .quantize import _lm_head

# Ops between a q/k/v projection and the attention that keep the heads' layout (reshape makes it).
_HEAD_WISE = ("reshape", "rmsnorm", "rope")


@dataclass(frozen=True)
class _Cut:
    """How a parameter is sharded: ``parts`` parts along ``axis`` (``layout`` names the kind); a
    ``partial`` one (a row-parallel bias) is whole on rank 0 and zeros elsewhere."""

    layout: Layout
    axis: int | None
    parts: int


class _Plan:
    """What to shard in ``graph``: parameters, reshapes (new head counts), caches, and the nodes whose
    output a collective completes."""

    def __init__(self, graph: Graph, tp: int) -> None:
        self.graph, self.tp = graph, tp
        self.producers = graph.producers()
        self.users = graph.users()
        self.cuts: dict[str, _Cut] = {}
        self.reshapes: dict[int, int] = {}      # reshape node id -> the new size of its axis 1
        self.caches: dict[str, int] = {}        # KV cache input -> its rank's KV heads
        self.reduced: set[int] = set()          # nodes followed by an all_reduce
        self.gathered: set[int] = set()         # nodes followed by an all_gather (the lm_head)
        self.embeddings: set[int] = set()       # vocab-parallel embeddings
        for node in graph.nodes:  # the heads first: what they allow is what a user most needs to know
            if node.op == "paged_attention":
                self._attention(node)
            elif node.op == "mul":
                self._mlp(node)
        for node in graph.nodes:
            if node.op == "embedding" and node.inputs[1] in graph.params:
                self._vocab(node.inputs[1], "the embedding")
                self.embeddings.add(id(node))
        head = _lm_head(graph, ("linear",))
        if head is not None and head.inputs[1] in graph.params:
            self._vocab(head.inputs[1], "the lm_head")
            self._column(head, self.tp)  # and its bias, if any
            self.gathered.add(id(head))

    def _attention(self, node: Node) -> None:
        heads, kv_heads = node.types[0].shape[1], self.graph.value_types()[node.inputs[1]].shape[1]
        if heads % self.tp:
            raise ValueError(f"tp={self.tp} must divide the attention heads ({heads} in {node.outputs[0]}); "
                             f"possible: {_divisors(heads)}")
        if kv_heads % self.tp and self.tp % kv_heads:
            raise ValueError(f"tp={self.tp} and the {kv_heads} KV heads of {node.outputs[0]}: one must divide the "
                             f"other (KV heads are split, or replicated when tp exceeds them)")
        kv_parts = min(kv_heads, self.tp)
        self._column(self._projection(node.inputs[0], heads // self.tp), self.tp)
        kv_store = self.producers[node.inputs[1]]
        for cache, value in zip(kv_store.inputs[:2], kv_store.inputs[2:4]):
            self.caches[cache] = kv_heads // kv_parts
            self._column(self._projection(value, kv_heads // kv_parts), kv_parts)
        flat = self._only_user(node.outputs[0], "reshape")
        self.reshapes[id(flat)] = flat.type.shape[1] // self.tp
        self._row(self._only_user(flat.out, "linear"))

    def _mlp(self, node: Node) -> None:
        gate_act, up = (self.producers.get(i) for i in node.inputs)
        gate = self.producers.get(gate_act.inputs[0]) if gate_act is not None and gate_act.op == "silu" else None
        if gate is None or gate.op != "linear" or up is None or up.op != "linear":
            return
        width = node.type.shape[1]
        if width % self.tp:
            raise ValueError(f"tp={self.tp} must divide the MLP's intermediate size ({width} in {node.out})")
        self._column(gate, self.tp)
        self._column(up, self.tp)
        self._row(self._only_user(node.out, "linear"))

    def _projection(self, value: str, rank_heads: int) -> Node:
        """The linear making ``value`` (followed back through head-wise ops); the reshape to heads on
        the way gets the rank's head count."""
        node = self.producers[value]
        while node.op in _HEAD_WISE:
            if node.op == "reshape":
                self.reshapes[id(node)] = rank_heads
            node = self.producers[node.inputs[0]]
        if node.op != "linear":
            raise ValueError(f"shard_tp: attention input {value} comes from {node.op}, not from a linear")
        return node

    def _only_user(self, value: str, op: str) -> Node:
        readers = self.users.get(value, [])
        if len(readers) != 1 or readers[0].op != op:
            raise ValueError(f"shard_tp: {value} must be read by one {op} only, got {[n.op for n in readers]}")
        return readers[0]

    def _column(self, linear: Node, parts: int) -> None:
        for param in linear.inputs[1:]:  # the weight's rows and the bias
            self._cut(param, _Cut(Layout.column, 0, parts))

    def _row(self, linear: Node) -> None:
        self._cut(linear.inputs[1], _Cut(Layout.row, 1, self.tp))
        if len(linear.inputs) > 2:  # the bias joins the partial sums once: on rank 0
            self._cut(linear.inputs[2], _Cut(Layout.partial, None, 1))
        self.reduced.add(id(linear))

    def _vocab(self, table: str, what: str) -> None:
        rows = self.graph.params[table].type.shape[0]
        if rows % self.tp:
            raise ValueError(f"tp={self.tp} must divide the vocabulary ({rows} rows of {what}, @{table})")
        self._cut(table, _Cut(Layout.column, 0, self.tp))

    def _cut(self, name: str, cut: _Cut) -> None:
        if name not in self.graph.params:
            raise ValueError(f"shard_tp: {name} is not a parameter")
        if self.cuts.setdefault(name, cut) != cut:
            raise ValueError(f"shard_tp: @{name} is read as {self.cuts[name]} and as {cut}")


def shard_tp(graph: Graph, ctx: PassContext) -> Graph:
    tp = ctx.tp
    if tp == 1:
        return graph
    plan = _Plan(graph, tp)
    taken = set(graph.value_types())
    params = {name: p for name, p in graph.params.items() if name not in plan.cuts}
    renamed: dict[str, str] = {}
    for name, cut in plan.cuts.items():
        param = graph.params[name]
        shape = list(param.type.shape)
        sharded = _fresh(f"{name}.shard", taken)
        if cut.layout == Layout.partial:
            ctx.add_recipe(FirstRank(sharded, name))
        else:
            shape[cut.axis] //= cut.parts
            ctx.add_recipe(Shard(sharded, name, cut.axis, cut.parts, tp))
        params[sharded] = Param(sharded, param.type.with_shape(tuple(shape)), param.format,
                                Placement(cut.layout, cut.axis))
        renamed[name] = sharded
    inputs = dict(graph.inputs)
    for cache, kv_heads in plan.caches.items():
        inputs[cache] = inputs[cache].with_shape((inputs[cache].shape[0], kv_heads, *inputs[cache].shape[2:]))
    types: dict[str, TensorType] = {**inputs, **{name: p.value_type for name, p in params.items()}}
    nodes: list[Node] = []

    def add(node: Node) -> None:
        nodes.append(node)
        types.update(zip(node.outputs, node.types))

    for node in graph.nodes:
        args = [renamed.get(i, i) for i in node.inputs]
        attrs = dict(node.attrs)
        if id(node) in plan.reshapes:
            shape = list(attrs["shape"])
            shape[1] = plan.reshapes[id(node)]
            attrs["shape"] = shape
        if id(node) in plan.embeddings:
            args.append(_row_start(node.inputs[1], graph.params[node.inputs[1]].type.shape[0], tp, params,
                                   types, taken, ctx))
        collective = id(node) in plan.reduced or id(node) in plan.gathered or id(node) in plan.embeddings
        outputs = [_fresh(f"{node.out}.part", taken)] if collective else list(node.outputs)
        add(make_node(node.op, args, outputs, [types[a] for a in args], attrs))
        if id(node) in plan.gathered:
            add(make_node("all_gather", outputs, node.outputs, [types[outputs[0]]], {"axis": 1, "world_size": tp}))
        elif collective:
            add(make_node("all_reduce", outputs, node.outputs, [types[outputs[0]]], {"world_size": tp}))
    return graph.replace(inputs=inputs, params=params, nodes=nodes)


def _row_start(table: str, rows: int, tp: int, params: dict[str, Param], types: dict[str, TensorType],
               taken: set[str], ctx: PassContext) -> str:
    """The parameter saying where a rank's rows of the vocabulary start: its part of the ``tp`` starts."""
    name = f"{table}.row_start"
    if name in params:
        return name
    starts = _fresh(f"{table}.row_starts", taken)
    name = _fresh(name, taken)
    ctx.add_recipe(Constant(starts, tuple(rank * rows // tp for rank in range(tp))))
    ctx.add_recipe(Shard(name, starts, 0, tp, tp))
    params[name] = Param(name, TensorType((1,), DType.i32), placement=Placement(Layout.column, 0))
    types[name] = params[name].type
    return name


def _fresh(name: str, taken: set[str]) -> str:
    candidate, number = name, 1
    while candidate in taken:
        candidate, number = f"{name}.{number}", number + 1
    taken.add(candidate)
    return candidate


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
