"""Fused ops: introduced by the compiler's fusion passes, never by model files.

Each is defined by the primitive ops it replaces (written in its doc), which is also what its
``ref_`` kernel computes.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .ops import AttrSpec, OpDef, expect, expect_same, register_op
from .ops_core import infer_kv_store, infer_rmsnorm, infer_rope
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
    {"eps": AttrSpec("float", 0.0)},
    _rope_kv_store, num_outputs=3, aliases=(None, 5, 6), has_effect=True,
    doc="with norms: q, k = rmsnorm(q, q_norm), rmsnorm(k, k_norm); then returns (rope(q), "
        "*kv_store(k_cache, v_cache, rope(k), v, slots))",
))
