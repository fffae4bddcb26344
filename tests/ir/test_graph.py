"""Graphs: builder typing, printer/parser and JSON round trips, and the verifier's rejections."""

import dataclasses

import pytest

from kiln.ir import DType, GraphBuilder, IRTypeError, TensorType, VerifyError, parse_graph, print_graph, verify
from kiln.ir.graph import FrozenAttrs, Node
from kiln.ir.serialize import dumps, loads


def small_graph():
    b = GraphBuilder("small")
    x = b.input("x", TensorType(("T", 64), DType.bf16))
    w = b.param("w", TensorType((64,), DType.bf16))
    qkv = b.param("qkv", TensorType((128, 64), DType.bf16))
    h = b.op("rmsnorm", x, w, eps=1e-5, name="h")
    y = b.op("linear", h, qkv)
    q, k = b.op("split", y, sizes=[96, 32], name="parts")
    r = b.op("reshape", q, shape=["T", 3, 32])
    b.output(r, k)
    return b.build()


def test_printer_text_is_stable():
    assert print_graph(small_graph()) == """graph small {
  input %x: bf16[T, 64]
  param @w: bf16[64]
  param @qkv: bf16[128, 64]
  %h = rmsnorm(%x, @w) {eps=1e-05} : bf16[T, 64]
  %0 = linear(%h, @qkv) : bf16[T, 128]
  %parts.0, %parts.1 = split(%0) {sizes=[96, 32]} : bf16[T, 96], bf16[T, 32]
  %1 = reshape(%parts.0) {shape=["T", 3, 32]} : bf16[T, 3, 32]
  return %1, %parts.1
}
"""


def test_text_and_json_round_trip():
    g = small_graph()
    verify(g)
    assert parse_graph(print_graph(g)) == g
    assert loads(dumps(g)) == g


def test_builder_rejects_ill_typed_ops():
    b = GraphBuilder("bad")
    x = b.input("x", TensorType(("T", 64), DType.bf16))
    w = b.param("w", TensorType((32, 48), DType.bf16))
    with pytest.raises(IRTypeError, match="in-features"):
        b.op("linear", x, w)
    with pytest.raises(IRTypeError, match="required"):
        b.op("rmsnorm", x, b.param("n", TensorType((64,), DType.bf16)))
    with pytest.raises(IRTypeError, match="unknown op"):
        b.op("conv9d", x)


def test_verifier_rejects_wrong_recorded_type():
    g = small_graph()
    node = g.nodes[0]
    wrong = dataclasses.replace(node, types=(TensorType(("T", 65), DType.bf16),))
    with pytest.raises(VerifyError, match="recorded types"):
        verify(g.replace(nodes=(wrong,) + g.nodes[1:]))


def test_verifier_rejects_use_before_definition_and_redefinition():
    g = small_graph()
    with pytest.raises(VerifyError, match="before it is defined"):
        verify(g.replace(nodes=g.nodes[1:]))
    dup = Node("rmsnorm", ("x", "w"), ("h",), g.nodes[0].types, FrozenAttrs({"eps": 1e-5}))
    with pytest.raises(VerifyError, match="redefines"):
        verify(g.replace(nodes=g.nodes + (dup,)))


def test_verifier_rejects_bad_attributes_and_missing_outputs():
    g = small_graph()
    node = dataclasses.replace(g.nodes[0], attrs=FrozenAttrs({"eps": "tiny"}))
    with pytest.raises(VerifyError, match="eps"):
        verify(g.replace(nodes=(node,) + g.nodes[1:]))
    with pytest.raises(VerifyError, match="not defined"):
        verify(g.replace(outputs=("nowhere",)))


def test_parser_reports_line_of_error():
    text = print_graph(small_graph()).replace(": bf16[T, 128]", ": bf16[T, 127]")
    with pytest.raises(ValueError, match="line 6"):
        parse_graph(text)


def test_silu_mul_linear_residual_types():
    b = GraphBuilder("mlp")
    w = b.param("w", TensorType((8, 6), DType.f32))
    r = b.input("r", TensorType(("T", 8), DType.f32))
    y = b.op("silu_mul_linear_residual", b.input("gu", TensorType(("T", 12), DType.f32)), w, r)
    assert b.type_of(y) == TensorType(("T", 8), DType.f32)
    with pytest.raises(IRTypeError, match="gate_up must have rank 2"):
        b.op("silu_mul_linear_residual", b.input("gu3", TensorType(("T", 2, 12), DType.f32)), w, r)
    with pytest.raises(IRTypeError, match="gate and up halves"):
        b.op("silu_mul_linear_residual", b.input("odd", TensorType(("T", 13), DType.f32)), w, r)
    with pytest.raises(IRTypeError, match="in-features"):
        b.op("silu_mul_linear_residual", b.input("wide", TensorType(("T", 16), DType.f32)), w, r)
