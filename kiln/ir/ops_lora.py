"""The LoRA ops: introduced by the ``insert_lora`` pass, never by model files.

    %lora_rows, %lora_tiles = lora_groups(%lora_slot, %q_start, %q_len) {slots=L}
    %y.lora_h = lora_shrink(%x, %lora_a, %lora_rows, %lora_tiles)
    %y.base = linear(%x, @w)
    %y = lora_expand(%y.base, %y.lora_h, %lora_b, %lora_rows, %lora_tiles) {slices=[q, k, v]}

``lora_groups`` runs once a step: it groups the step's token rows by adapter slot (each row takes
its sequence's ``lora_slot[b]``, the rows ``q_start[b] .. q_start[b] + q_len[b]`` being the
sequence's; rows of slot -1 and of no sequence are left out), in tiles of ``TILE_ROWS`` rows of one
slot (``kiln.lora_layout``): ``lora_rows[i]`` is tile i's rows (padded with ``T``, no row) and
``lora_tiles[i]`` its slot (-1: no tile). Each slot's rows are in token order and its tiles follow
one another, the slots in order; a step has at most ``T`` tiles (each holds a row), and every hook
of the step reads the same grouping instead of making its own.

A hook adds to each token row of the GEMM's output its adapter's update ``B[s] @ A[s] @ x`` (``s``:
the slot of the row's tile; rows in no tile: nothing) in two ops. ``lora_shrink`` makes ``h = A[s]
@ x`` (``[T, len(slices) * R]`` f32; rows in no tile: unspecified) from the GEMM's input alone, so it
runs on the step's side stream (``OpDef.side_stream``) while the GEMM runs; ``lora_expand`` adds
``h``'s update to the GEMM's output in place (``y`` is ``y_base``). ``y``'s columns are ``slices``
(a fused GEMM's members, in order); slice ``i`` reads columns ``i*R .. (i+1)*R`` of ``h``. Shapes:
``lora_a [L, n*R, in]``, ``lora_b [L, sum(slices), R]`` with L adapter slots of rank up to R
(``kiln.lora_layout``).

``prologue`` lets the shrink read the GEMM's input before the op that made it, so that op can still
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


def _grouping(op: str, rows: TensorType, tiles: TensorType, tokens: TensorType) -> None:
    for name, v, dims in (("lora_rows", rows, 2), ("lora_tiles", tiles, 1)):
        expect_int(op, name, v)
        expect_rank(op, name, v, dims)
        expect(same_dim(v.shape[0], tokens.shape[0]), f"{op}: {name} {v} is not a tile table of {tokens}'s rows")
    expect(rows.shape[1] == TILE_ROWS, f"{op}: lora_rows {rows} must hold {TILE_ROWS} rows a tile")


def _lora_shrink(t: Sequence[TensorType], a: Mapping[str, Any]) -> tuple[TensorType, ...]:
    x, lora_a, rows, tiles = t[:4]
    prologue = a.get("prologue", "none")
    expect(prologue in PROLOGUES, f"lora_shrink: prologue {prologue!r} is not one of {', '.join(PROLOGUES)}")
    expect((len(t) == 5) == (prologue == "rmsnorm"), "lora_shrink: a norm_weight goes with prologue='rmsnorm' only")
    expect_rank("lora_shrink", "x", x, 2)
    expect_rank("lora_shrink", "lora_a", lora_a, 3)
    expect(x.dtype == lora_a.dtype, f"lora_shrink: x {x} and lora_a {lora_a} must share a dtype")
    x_features = x.shape[1] // 2 if prologue == "silu_mul" and isinstance(x.shape[1], int) else x.shape[1]
    expect(same_dim(lora_a.shape[2], x_features), f"lora_shrink: lora_a {lora_a} does not match x {x} "
                                                  f"(prologue {prologue})")
    if prologue == "rmsnorm":
        expect(t[4].rank == 1 and same_dim(t[4].shape[0], x.shape[1]),
               f"lora_shrink: norm_weight {t[4]} does not match x {x}")
    _grouping("lora_shrink", rows, tiles, x)
    return (TensorType((x.shape[0], lora_a.shape[1]), DType.f32),)


def _lora_expand(t: Sequence[TensorType], a: Mapping[str, Any]) -> tuple[TensorType, ...]:
    y, h, lora_b, rows, tiles = t
    slices = list(a["slices"])
    expect_rank("lora_expand", "y", y, 2)
    expect_rank("lora_expand", "h", h, 2)
    expect_rank("lora_expand", "lora_b", lora_b, 3)
    expect(h.dtype == DType.f32, f"lora_expand: h {h} must be f32 (lora_shrink's output)")
    expect(same_dim(y.shape[0], h.shape[0]), f"lora_expand: y {y} and h {h} have different token counts")
    expect(y.dtype == lora_b.dtype, f"lora_expand: y {y} and lora_b {lora_b} must share a dtype")
    expect(slices and all(s > 0 for s in slices) and sum(slices) == y.shape[1],
           f"lora_expand: slices {slices} do not cover the {y.shape[1]} columns of y {y}")
    expect(h.shape[1] == len(slices) * lora_b.shape[2],
           f"lora_expand: h {h} needs {len(slices)} x rank {lora_b.shape[2]} columns")
    expect(same_dim(lora_b.shape[1], y.shape[1]), f"lora_expand: lora_b {lora_b} does not match y {y}")
    _grouping("lora_expand", rows, tiles, y)
    return (y,)


PROLOGUES = ("none", "rmsnorm", "silu_mul")
register_op(OpDef("lora_groups", ("lora_slot", "q_start", "q_len"), {"slots": AttrSpec("int")}, _lora_groups,
                  num_outputs=2,
                  doc="the step's token rows grouped by adapter slot, in tiles of TILE_ROWS rows of one slot"))
register_op(OpDef("lora_shrink", ("x", "lora_a", "lora_rows", "lora_tiles", "norm_weight?"),
                  {"prologue": AttrSpec("str", None), "eps": AttrSpec("float", None)}, _lora_shrink,
                  num_outputs=1, side_stream=True,
                  doc="h = A[s] @ x for each row of an adapter's tile (f32), on the side stream"))
register_op(OpDef("lora_expand", ("y", "h", "lora_b", "lora_rows", "lora_tiles"), {"slices": AttrSpec("ints")},
                  _lora_expand, num_outputs=1, aliases=(0,), has_effect=True,
                  doc="y += each row's adapter update B[s] @ h, per slice of y's columns"))
