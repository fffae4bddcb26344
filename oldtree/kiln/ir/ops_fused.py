"""Fused ops: introduced by the compiler's fusion passes, never by model files.

Each is defined by the primitive ops it replaces (written in its doc), which is also what its
``ref_`` kernel computes.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .ops import AttrSpec, OpDef, expect, expect_rank, expect_same, register_op
from .ops_core import KV_SCALE_ATTRS, LINEAR_ATTRS, infer_kv_store, infer_linear, infer_paged_attention, infer_rmsnorm, infer_rope
from .types import TensorType


def _add_rmsnorm(t: Sequence[TensorType], a: Mapping[str, Any]) -> tuple[TensorType, ...]:
    x, residual, weight = t
    expect_same("add_rmsnorm", x, residual)
    (normed,) = infer_rmsnorm((x, weight), a)
    return (normed, x)


def _silu_mul(t: Sequence[TensorType], a: Mapping[str, Any]) -> tuple[TensorType, ...]:
    expect_same("silu_mul", t[0], t[1])
    return (t[0],)


register_op(OpDef(
    "add_rmsnorm", ("x", "residual", "weight"),
    {"eps": AttrSpec("float")},
    _add_rmsnorm, num_outputs=2,
    doc="s = add(x, residual); returns (rmsnorm(s, weight), s)",
))
register_op(OpDef("silu_mul", ("gate", "up"), {}, _silu_mul, doc="mul(silu(gate), up)"))


def _rope_kv_store(t: Sequence[TensorType], a: Mapping[str, Any]) -> tuple[TensorType, ...]:
    q, k, v, positions, cos_sin, k_cache, v_cache, slots = t[:8]
    if len(t) > 8:
        expect(len(t) == 10, "rope_kv_store: q/k norm weights come as a pair")
        for x, w in ((q, t[8]), (k, t[9])):
            infer_rmsnorm((x, w), {"eps": a["eps"]})
    (q_rot,) = infer_rope((q, positions, cos_sin), a)
    infer_rope((k, positions, cos_sin), a)
    return (q_rot,) + infer_kv_store((k_cache, v_cache, k, v, slots), a)


register_op(OpDef(
    "rope_kv_store", ("q", "k", "v", "positions", "cos_sin", "k_cache", "v_cache", "slots", "q_norm?", "k_norm?"),
    {"eps": AttrSpec("float", 0.0), **KV_SCALE_ATTRS},
    _rope_kv_store, num_outputs=3, aliases=(None, 5, 6), has_effect=True,
    doc="with norms: q, k = rmsnorm(q, q_norm), rmsnorm(k, k_norm); then returns (rope(q), "
        "*kv_store(k_cache, v_cache, rope(k), v, slots))",
))


def _rope_kv_attention(t: Sequence[TensorType], a: Mapping[str, Any]) -> tuple[TensorType, ...]:
    q_rot, k_cache, v_cache = _rope_kv_store(t[:8], {"eps": 0.0})
    return infer_paged_attention((q_rot, k_cache, v_cache, *t[8:]), a) + (k_cache, v_cache)


register_op(OpDef(
    "rope_kv_attention",
    ("q", "k", "v", "positions", "cos_sin", "k_cache", "v_cache", "slots", "q_start", "q_len", "kv_len", "page_table",
     "tree_mask?"),
    {"scale": AttrSpec("float"), "page_size": AttrSpec("int"), "sliding_window": AttrSpec("int", 0),
     "soft_cap": AttrSpec("float", 0.0), **KV_SCALE_ATTRS},
    _rope_kv_attention, num_outputs=3, aliases=(None, 5, 6), has_effect=True,
    doc="q_rot, k_cache, v_cache = rope_kv_store(q, k, v, positions, cos_sin, k_cache, v_cache, slots); returns "
        "(paged_attention(q_rot, k_cache, v_cache, q_start, q_len, kv_len, page_table[, tree_mask]), k_cache, v_cache)",
))


# GEMMs with their neighbours folded in: at decode's few rows one launch reads the weights once and
# applies the norm or the gated activation before and the residual after; at prefill's many rows the
# kernels compose the unfused parts. The residual add moves into the GEMM before it (``linear_residual``),
# which leaves each RMSNorm reading that sum directly, free to join the GEMM after it. The gated
# activation joins the down GEMM after it rather than the gate/up GEMM before it: where the gate/up
# weight is too large for the GEMV (Llama-3-8B's 235 MB at one row) the activation is then still
# fused, instead of being a kernel of its own between cuBLAS and the down GEMV.

def _rmsnorm_linear(t: Sequence[TensorType], a: Mapping[str, Any]) -> tuple[TensorType, ...]:
    x, norm_weight, weight = t[:3]
    (normed,) = infer_rmsnorm((x, norm_weight), a)
    return infer_linear((normed,) + tuple(t[2:]), a)


def _linear_residual(t: Sequence[TensorType], a: Mapping[str, Any]) -> tuple[TensorType, ...]:
    x, weight, residual = t
    (y,) = infer_linear((x, weight), a)
    expect_same("linear_residual", y, residual)
    return (y,)


def _silu_mul_linear_residual(t: Sequence[TensorType], a: Mapping[str, Any]) -> tuple[TensorType, ...]:
    gate_up, weight, residual = t
    expect_rank("silu_mul_linear_residual", "gate_up", gate_up, 2)
    rows, width = gate_up.shape
    expect(isinstance(width, int) and width % 2 == 0,
           f"silu_mul_linear_residual: gate_up {gate_up} must hold gate and up halves (an even, static width)")
    return _linear_residual((gate_up.with_shape((rows, width // 2)), weight, residual), a)


register_op(OpDef(
    "rmsnorm_linear", ("x", "norm_weight", "weight", "bias?"), {"eps": AttrSpec("float"), **LINEAR_ATTRS},
    _rmsnorm_linear, quantized=("weight",), doc="linear(rmsnorm(x, norm_weight), weight, bias)",
))
# Their output may take over the residual's storage (the residual stream is read last here): then no
# copy of the residual into a fresh output precedes cuBLAS's beta=1 GEMM.
register_op(OpDef(
    "linear_residual", ("x", "weight", "residual"), LINEAR_ATTRS, _linear_residual, reuses=(2,), quantized=("weight",),
    doc="add(linear(x, weight), residual)",
))
register_op(OpDef(
    "silu_mul_linear_residual", ("gate_up", "weight", "residual"), LINEAR_ATTRS, _silu_mul_linear_residual, reuses=(2,),
    quantized=("weight",),
    doc="gate, up = split(gate_up, 2 halves); add(linear(silu_mul(gate, up), weight), residual)",
))
