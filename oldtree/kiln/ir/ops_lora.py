"""The LoRA ops: introduced by the ``insert_lora`` pass, never by model files.

    %lora_rows, %lora_tiles = lora_groups(%lora_slot, %q_start, %q_len) {slots=L}
    %y, %h = lora(%y_base, %x, %lora_a, %lora_b, %lora_rows, %lora_tiles) {slices=[q, k, v]}

``lora_groups`` runs once a step: it groups the step's token rows by adapter slot (each row takes
its sequence's ``lora_slot[b]``, the rows ``q_start[b] .. q_start[b] + q_len[b]`` being the
sequence's; rows of slot -1 and of no sequence are left out), in tiles of ``TILE_ROWS`` rows of one
slot (``kiln.lora_layout``): ``lora_rows[i]`` is tile i's rows (padded with ``T``, no row) and
``lora_tiles[i]`` its slot (-1: no tile). Each slot's rows are in token order and its tiles follow
one another, the slots in order; a step has at most ``T`` tiles (each holds a row), and every hook
of the step reads the same grouping instead of making its own.

``lora`` adds to each token row of ``y_base`` (in place: ``y`` is ``y_base``) its adapter's update
``B[s] @ A[s] @ x`` (``s``: the slot of the row's tile; rows in no tile: nothing). ``y``'s columns
are ``slices`` (a fused GEMM's members, in order); slice ``i`` reads rows ``i*R .. (i+1)*R`` of
``A[s] @ x``, which the op leaves in ``h`` (``[T, len(slices) * R]`` f32, the shrink's result).
Shapes: ``lora_a [L, n*R, in]``, ``lora_b [L, sum(slices), R]`` with L adapter slots of rank up to
R (``kiln.lora_layout``).

``prologue`` lets the op read the GEMM's input before the op that made it, so that op can still
join the GEMM (``fuse_norm_linear``, ``fuse_silu_mul_linear``): ``rmsnorm`` (x is the norm's input,
``norm_weight`` and ``eps`` its own) or ``silu_mul`` (x is the gate/up GEMM's output ``[T, 2I]``).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from kiln.lora_layout import TILE_ROWS
from kiln.step_schema import TOKEN

from .ops import AttrSpec, OpDef, expect, expect_int, expect_rank, register_op
from .types import DType, TensorType, same_dim


def _lora_groups(t: Sequence[TensorType], a: Mapping[str, Any]) -> tuple[TensorType, ...]:
    slot = t[0]
    expect(a["slots"] >= 1, f"lora_groups: slots must be >= 1, got {a['slots']}")
    for name, v in zip(("lora_slot", "q_start", "q_len"), t):
        expect_int("lora_groups", name, v)
        expect_rank("lora_groups", name, v, 1)
        expect(same_dim(v.shape[0], slot.shape[0]), f"lora_groups: {name} {v} has a different batch size")
    return (TensorType((TOKEN, TILE_ROWS), DType.i32), TensorType((TOKEN,), DType.i32))


def _lora(t: Sequence[TensorType], a: Mapping[str, Any]) -> tuple[TensorType, ...]:
    y, x, lora_a, lora_b, rows, tiles = t[:6]
    slices = list(a["slices"])
    prologue = a.get("prologue", "none")
    expect(prologue in PROLOGUES, f"lora: prologue {prologue!r} is not one of {', '.join(PROLOGUES)}")
    expect((len(t) == 7) == (prologue == "rmsnorm"), "lora: a norm_weight goes with prologue='rmsnorm' only")
    expect_rank("lora", "y", y, 2)
    expect_rank("lora", "x", x, 2)
    expect_rank("lora", "lora_a", lora_a, 3)
    expect_rank("lora", "lora_b", lora_b, 3)
    expect(same_dim(y.shape[0], x.shape[0]), f"lora: y {y} and x {x} have different token counts")
    expect(y.dtype == x.dtype == lora_a.dtype == lora_b.dtype, f"lora: y {y}, x {x}, lora_a {lora_a} and lora_b "
                                                                 f"{lora_b} must share a dtype")
    expect(slices and all(s > 0 for s in slices) and sum(slices) == y.shape[1],
           f"lora: slices {slices} do not cover the {y.shape[1]} columns of y {y}")
    slots, lora_rows, in_features = lora_a.shape
    rank = lora_b.shape[2]
    x_features = x.shape[1] // 2 if prologue == "silu_mul" and isinstance(x.shape[1], int) else x.shape[1]
    expect(same_dim(in_features, x_features), f"lora: lora_a {lora_a} does not match x {x} (prologue {prologue})")
    if prologue == "rmsnorm":
        expect(t[6].rank == 1 and same_dim(t[6].shape[0], x.shape[1]), f"lora: norm_weight {t[6]} does not match x {x}")
    expect(lora_rows == len(slices) * rank, f"lora: lora_a {lora_a} needs {len(slices)} x rank {rank} rows")
    expect(lora_b.shape[:2] == (slots, y.shape[1]), f"lora: lora_b {lora_b} does not match y {y} and lora_a {lora_a}")
    for name, v, dims in (("lora_rows", rows, 2), ("lora_tiles", tiles, 1)):
        expect_int("lora", name, v)
        expect_rank("lora", name, v, dims)
        expect(same_dim(v.shape[0], x.shape[0]), f"lora: {name} {v} is not a tile table of x {x}'s rows")
    expect(rows.shape[1] == TILE_ROWS, f"lora: lora_rows {rows} must hold {TILE_ROWS} rows a tile")
    return (y, TensorType((x.shape[0], lora_rows), DType.f32))


PROLOGUES = ("none", "rmsnorm", "silu_mul")
register_op(OpDef("lora_groups", ("lora_slot", "q_start", "q_len"), {"slots": AttrSpec("int")}, _lora_groups,
                  num_outputs=2,
                  doc="the step's token rows grouped by adapter slot, in tiles of TILE_ROWS rows of one slot"))
register_op(OpDef("lora", ("y", "x", "lora_a", "lora_b", "lora_rows", "lora_tiles", "norm_weight?"),
                  {"slices": AttrSpec("ints"), "prologue": AttrSpec("str", None), "eps": AttrSpec("float", None)},
                  _lora, num_outputs=2, aliases=(0, None), has_effect=True,
                  doc="y += each row's adapter update B[s] @ A[s] @ x (no tile: none), per slice of y's columns"))
