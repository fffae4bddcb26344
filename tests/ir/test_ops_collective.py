"""The collective ops: their type rules, their text form (printed, parsed back, verified) and the
verifier's rejections of what cannot run."""

import textwrap

import pytest

from kiln.ir import DType, GraphBuilder, IRTypeError, TensorType, parse_graph, print_graph, verify


def collective_graph():
    b = GraphBuilder("ranks")
    x = b.input("x", TensorType(("T", 6), DType.bf16))
    summed = b.op("all_reduce", x, world_size=3, name="summed")
    gathered = b.op("all_gather", summed, axis=1, world_size=3, name="gathered")
    mine = b.op("reduce_scatter", gathered, axis=1, world_size=3, name="mine")
    sent = b.op("send", mine, peer=1, name="sent")
    got = b.op("recv", shape=["T", 6], dtype="bf16", peer=1, name="got")
    b.output(sent, got)
    return b.build()


def test_collectives_print_parse_and_verify():
    text = print_graph(collective_graph())
    assert text == textwrap.dedent("""\
        graph ranks {
          input %x: bf16[T, 6]
          %summed = all_reduce(%x) {world_size=3} : bf16[T, 6]
          %gathered = all_gather(%summed) {axis=1, world_size=3} : bf16[T, 18]
          %mine = reduce_scatter(%gathered) {axis=1, world_size=3} : bf16[T, 6]
          %sent = send(%mine) {peer=1} : bf16[T, 6]
          %got = recv() {dtype="bf16", peer=1, shape=["T", 6]} : bf16[T, 6]
          return %sent, %got
        }
        """)
    parsed = parse_graph(text)
    verify(parsed)
    assert parsed == collective_graph()


@pytest.mark.parametrize("op, attrs, message", [
    ("all_reduce", {"world_size": 1}, "world_size must be >= 2"),
    ("all_gather", {"axis": 2, "world_size": 2}, "axis 2 is not an axis"),
    ("all_gather", {"axis": 0, "world_size": 2}, "must be static"),
    ("reduce_scatter", {"axis": 1, "world_size": 4}, "does not split into 4 parts"),
    ("send", {"peer": -1}, "peer must be a rank"),
    ("all_reduce", {"world_size": 2, "group": "dp"}, "group must be one of tp, pp, got 'dp'"),
    ("send", {"peer": 1, "group": "world"}, "group must be one of tp, pp, got 'world'"),
])
def test_collectives_reject_what_cannot_run(op, attrs, message):
    b = GraphBuilder("bad")
    x = b.input("x", TensorType(("T", 6), DType.f32))
    with pytest.raises(IRTypeError, match=message):
        b.op(op, x, **attrs)


def test_a_collective_may_name_a_group_of_the_rank_grid():
    text = textwrap.dedent("""\
        graph stage {
          input %x: f32[T, 6]
          %summed = all_reduce(%x) {group="tp", world_size=2} : f32[T, 6]
          %h = recv() {dtype="f32", group="pp", peer=0, shape=["T", 6]} : f32[T, 6]
          %sent = send(%summed) {group="pp", peer=1} : f32[T, 6]
          return %sent, %h
        }
        """)
    graph = parse_graph(text)
    verify(graph)
    assert print_graph(graph) == text


def test_embedding_takes_a_row_start_of_one_index():
    b = GraphBuilder("vocab")
    ids = b.input("ids", TensorType(("T",), DType.i32))
    table = b.param("table", TensorType((8, 4), DType.f32))
    start = b.param("start", TensorType((1,), DType.i32))
    assert b.type_of(b.op("embedding", ids, table, start)) == TensorType(("T", 4), DType.f32)
    wide = b.param("wide", TensorType((2,), DType.i32))
    with pytest.raises(IRTypeError, match="row_start must be one index"):
        b.op("embedding", ids, table, wide)
