"""Mixture-of-experts ops: the router's top-k and the routed experts' gated MLP.

A sparse MoE block is ``router_topk(linear(x, router_weight))`` followed by ``moe`` over the experts'
stacked weights (``moe_residual`` once the residual add after it is folded in); a shared expert
(Qwen2-MoE) is ordinary ops beside it: a dense gated MLP whose output ``scale_rows`` multiplies by
``sigmoid(linear(x, shared_gate_weight))``.

Expert parallelism: ``moe`` holds experts ``expert_offset + start .. expert_offset + start + E - 1`` of
the model's (``E`` = the stacked weights' first dim; ``start`` = the optional ``expert_start`` input,
an i32[1], 0 when absent) and skips a token's choice of any other expert. The ``shard_ep`` pass
(``compiler/passes/shard_ep.py``) gives rank r a contiguous slice of the stacked weights
(``Placement.expert`` along axis 0, a ``Shard`` of the ``Stack``) and its first expert as that
rank's ``expert_start`` parameter: every rank runs the same program, so what differs between ranks
is data (a weight), never an attribute. Each rank's output is then its experts' part of the sum,
and an ``all_reduce`` of the outputs makes the whole. The router stays replicated, so every rank
sees every token's ids and weights.

Quantized experts: a quantized stacked weight would be a ``QuantizedType`` of logical shape
``[E, 2I, H]`` whose scales carry the expert axis too (per expert and output channel: ``[E, 2I]``);
``moe`` would then declare ``quantized=("w_gate_up", "w_down")`` as the linear family does. Not yet.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .ops import AttrSpec, OpDef, expect, expect_int, expect_rank, register_op
from .types import DType, TensorType, same_dim

Types = Sequence[TensorType]
Attrs = Mapping[str, Any]

# Router scoring functions kiln implements; a model refuses any other at compile time.
ROUTER_SCORING = ("softmax",)


def _router_topk(t: Types, a: Attrs) -> tuple[TensorType, ...]:
    (logits,) = t
    expect_rank("router_topk", "logits", logits, 2)
    experts = logits.shape[1]
    expect(isinstance(experts, int), f"router_topk: expert count of {logits} must be static")
    expect(1 <= a["top_k"] <= experts, f"router_topk: top_k={a['top_k']} must be in 1..{experts} (the experts)")
    expect(a["scoring"] in ROUTER_SCORING,
           f"router_topk: scoring {a['scoring']!r} is not supported; supported: {', '.join(ROUTER_SCORING)}")
    rows = logits.shape[0]
    return (TensorType((rows, a["top_k"]), DType.f32), TensorType((rows, a["top_k"]), DType.i32))


ROUTER_ATTRS = {"top_k": AttrSpec("int"), "renormalize": AttrSpec("bool", False),
                "scoring": AttrSpec("str", "softmax")}

register_op(OpDef(
    "router_topk", ("logits",), ROUTER_ATTRS, _router_topk, num_outputs=2,
    doc="p = softmax(f32(logits)) over experts; returns (weights, ids) of the top_k largest p per row, "
        "weights divided by their sum when renormalize (f32; ids i32, largest first)",
))


def _moe(t: Types, a: Attrs) -> tuple[TensorType, ...]:
    x, weights, ids, w_gate_up, w_down = t[:5]
    if len(t) > 5:
        expect_int("moe", "expert_start", t[5])
        expect(t[5].shape == (1,), f"moe: expert_start must be one index ([1]), got {t[5]}")
    expect_rank("moe", "x", x, 2)
    expect_rank("moe", "w_gate_up", w_gate_up, 3)
    expect_rank("moe", "w_down", w_down, 3)
    experts, two_i, hidden = w_gate_up.shape
    expect(isinstance(two_i, int) and two_i % 2 == 0,
           f"moe: w_gate_up {w_gate_up} must hold gate and up halves (an even, static second dim)")
    expect(same_dim(hidden, x.shape[1]), f"moe: w_gate_up {w_gate_up} does not match x {x}")
    expect(w_down.shape == (experts, x.shape[1], two_i // 2), f"moe: w_down {w_down} must be [E, H, I] for "
           f"w_gate_up {w_gate_up}")
    expect(x.dtype == w_gate_up.dtype == w_down.dtype, f"moe: x {x} and the expert weights differ in dtype")
    expect_int("moe", "ids", ids)
    expect_rank("moe", "ids", ids, 2)
    expect(weights.dtype == DType.f32 and weights.shape == ids.shape,
           f"moe: routing weights {weights} must be f32 and match ids {ids}")
    expect(same_dim(ids.shape[0], x.shape[0]), f"moe: ids {ids} do not match x {x}")
    expect(a["expert_offset"] >= 0, "moe: expert_offset must be >= 0")
    return (x,)


register_op(OpDef(
    "moe", ("x", "weights", "ids", "w_gate_up", "w_down", "expert_start?"),
    {"expert_offset": AttrSpec("int", 0)},
    _moe,
    doc="for each row t and choice j with e = ids[t, j] - expert_offset - expert_start in 0..E-1: gate, up = split(linear(x[t], "
        "w_gate_up[e]), 2 halves); out[t] += weights[t, j] * linear(silu_mul(gate, up), w_down[e]) "
        "(choices of other experts add nothing)",
))


def _moe_residual(t: Types, a: Attrs) -> tuple[TensorType, ...]:
    (out,) = _moe(t[:5], a)
    expect(t[5] == out, f"moe_residual: residual {t[5]} must be the experts' output type {out}")
    return (out,)


# The residual add after the experts, folded into them (fuse_linear_residual): decode's down GEMV
# adds it in its epilogue. No expert_start: under expert parallelism the add follows the all_reduce.
# Like linear_residual, it may write the residual stream in place.
register_op(OpDef(
    "moe_residual", ("x", "weights", "ids", "w_gate_up", "w_down", "residual"),
    {"expert_offset": AttrSpec("int", 0)},
    _moe_residual, reuses=(5,),
    doc="add(residual, moe(x, weights, ids, w_gate_up, w_down)): moe's output rounded to x's dtype, then added",
))

def _place_experts(t: Types, a: Attrs) -> tuple[TensorType, ...]:
    ids, table = t
    expect_int("place_experts", "ids", ids)
    expect_rank("place_experts", "ids", ids, 2)
    expect(table.dtype == DType.i32 and table.rank == 2, f"place_experts: table {table} must be an i32 [E, copies]")
    return (ids,)


# Redundant experts (compiler/passes/place_experts.py): a logical expert's choice goes to one of its
# physical copies, picked by the row, so a replicated expert's tokens spread evenly over its copies.
register_op(OpDef(
    "place_experts", ("ids", "table"), {}, _place_experts,
    doc="out[t, j] = table[ids[t, j], t % C] (C = table's columns: each expert's physical slots, repeated "
        "cyclically to fill them)",
))


def _count_experts(t: Types, a: Attrs) -> tuple[TensorType, ...]:
    counts, ids, slots = t
    expect(counts.dtype == DType.i64 and counts.rank == 1, f"count_experts: counts {counts} must be an i64 [E]")
    expect_int("count_experts", "ids", ids)
    expect_rank("count_experts", "ids", ids, 2)
    expect(slots.rank == 1 and same_dim(slots.shape[0], ids.shape[0]),
           f"count_experts: slots {slots} must have a row of ids {ids} each")
    return (counts,)


# Load visibility (compiler/passes/count_expert_load.py): a layer's tokens per expert, accumulated in
# place over the steps in a state input the runtime owns, as the KV pool's kv_store does.
register_op(OpDef(
    "count_experts", ("counts", "ids", "slots"), {}, _count_experts, aliases=(0,), has_effect=True,
    doc="counts[e] += the choices of expert e in ids, over rows whose slot is >= 0 (padding rows store no KV "
        "and count nothing); returns counts",
))


def _router_topk_count(t: Types, a: Attrs) -> tuple[TensorType, ...]:
    logits, counts, slots = t
    weights, ids = _router_topk((logits,), a)
    return (weights, ids) + _count_experts((counts, ids, slots), a)


# A router and its layer's load counter in one op (compiler/passes/fuse_router_count.py): at decode
# the count is one more launch of a few hundred bytes a sparse layer.
register_op(OpDef(
    "router_topk_count", ("logits", "counts", "slots"), ROUTER_ATTRS, _router_topk_count, num_outputs=3,
    aliases=(None, None, 1), has_effect=True,
    doc="weights, ids = router_topk(logits); counts = count_experts(counts, ids, slots); returns (weights, "
        "ids, counts)",
))


def _scale_rows(t: Types, a: Attrs) -> tuple[TensorType, ...]:
    x, scale = t
    expect_rank("scale_rows", "x", x, 2)
    expect(scale.rank == 2 and scale.shape[1] == 1 and same_dim(scale.shape[0], x.shape[0])
           and scale.dtype == x.dtype, f"scale_rows: scale {scale} must be [rows, 1] of x {x}")
    return (x,)


register_op(OpDef("sigmoid", ("x",), {}, lambda t, a: (t[0],)))
register_op(OpDef("scale_rows", ("x", "scale"), {}, _scale_rows, doc="x * scale, scale [rows, 1] broadcast along each row"))
