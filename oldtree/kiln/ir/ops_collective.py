"""Collective ops: how the ranks of a tensor- or pipeline-parallel program exchange values.

Introduced by the sharding passes (``shard_tp``, ``split_pipeline``), never by model files, and only
where there is more than one rank: a one-rank graph has none. Every collective runs over a process
group of ``world_size`` ranks, which its attribute records so that the type rule can size the result
and the kernel can check the group it runs in: the default group of all ranks, or, with ``group``,
one of the rank grid's axes (``"tp"``: the ranks of this rank's pipeline stage; ``"pp"``: the ranks
holding this rank's shard in every stage, where a peer is a stage number). All ranks of a group run
the same program, so each collective is met by every rank of it in the same order.

    %o = all_reduce(%o_part) {world_size=2}                   : bf16[T, 64]   (sum over the ranks)
    %logits = all_gather(%part) {axis=1, world_size=2}       : bf16[N, 320]  (rank r's part at r)
    %mine = reduce_scatter(%x) {axis=1, world_size=2}        : bf16[T, 32]   (the sum's part r)
    %sent = send(%x) {peer=1}                                : bf16[T, 64]   (x, sent to rank peer)
    %x = recv() {dtype="bf16", peer=0, shape=["T", 64]}      : bf16[T, 64]
    %h = recv() {dtype="bf16", group="pp", peer=0, shape=["T", 64]} : bf16[T, 64] (from stage 0)
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .ops import AttrSpec, OpDef, expect, register_op
from .types import DType, TensorType

Types = Sequence[TensorType]
Attrs = Mapping[str, Any]
# The rank grid's axes a collective's ``group`` may name (runtime/worker/rank_grid.py).
GROUPS = ("tp", "pp")


def _axis(op: str, x: TensorType, a: Attrs) -> int:
    axis = a["axis"]
    expect(0 <= axis < x.rank, f"{op}: axis {axis} is not an axis of {x}")
    expect(isinstance(x.shape[axis], int), f"{op}: axis {axis} of {x} must be static")
    return axis


def _all_reduce(t: Types, a: Attrs) -> tuple[TensorType, ...]:
    _world_size("all_reduce", a)
    return (t[0],)


def _all_gather(t: Types, a: Attrs) -> tuple[TensorType, ...]:
    x = t[0]
    size, axis = _world_size("all_gather", a), _axis("all_gather", x, a)
    shape = list(x.shape)
    shape[axis] *= size
    return (x.with_shape(tuple(shape)),)


def _reduce_scatter(t: Types, a: Attrs) -> tuple[TensorType, ...]:
    x = t[0]
    size, axis = _world_size("reduce_scatter", a), _axis("reduce_scatter", x, a)
    expect(x.shape[axis] % size == 0, f"reduce_scatter: axis {axis} of {x} does not split into {size} parts")
    shape = list(x.shape)
    shape[axis] //= size
    return (x.with_shape(tuple(shape)),)


def _group(op: str, a: Attrs) -> None:
    group = a.get("group")
    expect(group is None or group in GROUPS, f"{op}: group must be one of {', '.join(GROUPS)}, got {group!r}")


def _world_size(op: str, a: Attrs) -> int:
    size = a["world_size"]
    expect(size >= 2, f"{op}: world_size must be >= 2 (one rank needs no collective), got {size}")
    _group(op, a)
    return size


def _peer(op: str, a: Attrs) -> None:
    expect(a["peer"] >= 0, f"{op}: peer must be a rank (>= 0), got {a['peer']}")
    _group(op, a)


def _send(t: Types, a: Attrs) -> tuple[TensorType, ...]:
    _peer("send", a)
    return (t[0],)


def _recv(t: Types, a: Attrs) -> tuple[TensorType, ...]:
    _peer("recv", a)
    return (TensorType(tuple(a["shape"]), DType(a["dtype"])),)


# Which group: absent, the default one (every rank); else an axis of the rank grid (GROUPS).
GROUP = {"group": AttrSpec("str", None)}
WORLD = {"world_size": AttrSpec("int"), **GROUP}
register_op(OpDef("all_reduce", ("x",), WORLD, _all_reduce,
                  doc="the sum of x over the ranks, on every rank"))
register_op(OpDef("all_gather", ("x",), {"axis": AttrSpec("int"), **WORLD}, _all_gather,
                  doc="every rank's x joined along axis, in rank order, on every rank"))
register_op(OpDef("reduce_scatter", ("x",), {"axis": AttrSpec("int"), **WORLD}, _reduce_scatter,
                  doc="part r (along axis) of the sum of x over the ranks, on rank r"))
register_op(OpDef("send", ("x",), {"peer": AttrSpec("int"), **GROUP}, _send, aliases=(0,), has_effect=True,
                  doc="sends x to rank peer; returns x"))
register_op(OpDef("recv", (), {"shape": AttrSpec("dims"), "dtype": AttrSpec("dtype"), "peer": AttrSpec("int"),
                                    **GROUP}, _recv, has_effect=True, doc="the tensor rank peer sends"))
