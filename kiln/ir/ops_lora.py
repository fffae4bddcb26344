"""The LoRA op: introduced by the ``insert_lora`` pass, never by model files.

    %y, %h = lora(%y_base, %x, %lora_a, %lora_b, %lora_slot, %q_start, %q_len) {slices=[q, k, v]}

adds to each token row of ``y_base`` (in place: ``y`` is ``y_base``) its sequence's adapter's update
``B[s] @ A[s] @ x`` (``s = lora_slot[b]`` for the sequence ``b`` whose rows ``q_start[b] ..
q_start[b] + q_len[b]`` hold the token; ``s = -1``: nothing). ``y``'s columns are ``slices`` (a fused
GEMM's members, in order); slice ``i`` reads rows ``i*R .. (i+1)*R`` of ``A[s] @ x``, which the op
leaves in ``h`` (``[T, len(slices) * R]`` f32, the shrink's result). Shapes: ``lora_a [L, n*R, in]``,
``lora_b [L, sum(slices), R]`` with L adapter slots of rank up to R (``kiln.lora_layout``).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .ops import AttrSpec, OpDef, expect, expect_int, expect_rank, register_op
from .types import DType, TensorType, same_dim


def _lora(t: Sequence[TensorType], a: Mapping[str, Any]) -> tuple[TensorType, ...]:
    y, x, lora_a, lora_b, slot, q_start, q_len = t
    slices = list(a["slices"])
    expect_rank("lora", "y", y, 2)
    expect_rank("lora", "x", x, 2)
    expect_rank("lora", "lora_a", lora_a, 3)
    expect_rank("lora", "lora_b", lora_b, 3)
    expect(same_dim(y.shape[0], x.shape[0]), f"lora: y {y} and x {x} have different token counts")
    expect(y.dtype == x.dtype == lora_a.dtype == lora_b.dtype, f"lora: y {y}, x {x}, lora_a {lora_a} and lora_b "
                                                                 f"{lora_b} must share a dtype")
    expect(slices and all(s > 0 for s in slices) and sum(slices) == y.shape[1],
           f"lora: slices {slices} do not cover the {y.shape[1]} columns of y {y}")
    slots, rows, in_features = lora_a.shape
    rank = lora_b.shape[2]
    expect(same_dim(in_features, x.shape[1]), f"lora: lora_a {lora_a} does not match x {x}")
    expect(rows == len(slices) * rank, f"lora: lora_a {lora_a} needs {len(slices)} x rank {rank} rows")
    expect(lora_b.shape[:2] == (slots, y.shape[1]), f"lora: lora_b {lora_b} does not match y {y} and lora_a {lora_a}")
    for name, v in (("lora_slot", slot), ("q_start", q_start), ("q_len", q_len)):
        expect_int("lora", name, v)
        expect_rank("lora", name, v, 1)
        expect(same_dim(v.shape[0], slot.shape[0]), f"lora: {name} {v} has a different batch size")
    return (y, TensorType((x.shape[0], rows), DType.f32))


register_op(OpDef("lora", ("y", "x", "lora_a", "lora_b", "lora_slot", "q_start", "q_len"),
                  {"slices": AttrSpec("ints")}, _lora, num_outputs=2, aliases=(0, None), has_effect=True,
                  doc="y += each sequence's adapter update B[s] @ A[s] @ x (slot -1: none), per slice of y's columns"))
