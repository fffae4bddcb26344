"""Fused ops: introduced by the compiler's fusion passes, never by model files.

Each is defined by the primitive ops it replaces (written in its doc), which is also what its
``ref_`` kernel computes.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .ops import AttrSpec, OpDef, expect_same, register_op
from .ops_core import infer_rmsnorm
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
