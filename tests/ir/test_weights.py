"""Weight formats and placements on parameters: text and JSON round trips, the verifier's checks, and
how type inference reads a quantized weight."""

import dataclasses

import pytest

from kiln.ir import DType, GraphBuilder, IRTypeError, TensorType, VerifyError, parse_graph, print_graph, verify
from kiln.ir.serialize import dumps, loads
from kiln.ir.weights import SCHEMES, Layout, Placement, QuantizedType, WeightFormat

INT8 = WeightFormat(SCHEMES["int8_channel"], ("up.scale",))
MXFP4 = WeightFormat(SCHEMES["mxfp4"], ("down.scale",))


def quantized_mlp():
    b = GraphBuilder("mlp")
    x = b.input("x", TensorType(("T", 64), DType.bf16))
    b.param("up.scale", TensorType((32,), DType.f32))
    up = b.param("up", TensorType((32, 64), DType.i8), INT8, Placement(Layout.column, 0))
    b.param("down.scale", TensorType((64, 1), DType.u8))
    down = b.param("down", TensorType((64, 16), DType.u8), MXFP4, Placement(Layout.row, 1))
    experts = b.param("experts", TensorType((4, 64), DType.bf16), placement=Placement(Layout.expert, 0))
    h = b.op("linear", x, up, name="h")
    y = b.op("linear", h, down, name="y")
    b.output(y, b.op("embedding", b.input("ids", TensorType(("T",), DType.i32)), experts, name="e"))
    return b.build()


def test_formats_and_placements_print_and_parse_back():
    g = quantized_mlp()
    verify(g)
    assert print_graph(g) == """graph mlp {
  input %x: bf16[T, 64]
  input %ids: i32[T]
  param @up.scale: f32[32]
  param @up: i8[32, 64] format=int8_channel(@up.scale) placement=column(0)
  param @down.scale: u8[64, 1]
  param @down: u8[64, 16] format=mxfp4(@down.scale) placement=row(1)
  param @experts: bf16[4, 64] placement=expert(0)
  %h = linear(%x, @up) : bf16[T, 32]
  %y = linear(%h, @down) : bf16[T, 64]
  %e = embedding(%ids, @experts) : bf16[T, 64]
  return %y, %e
}
"""
    assert parse_graph(print_graph(g)) == g
    assert loads(dumps(g)) == g
    assert loads(dumps(g)).params["down"].format == MXFP4


def test_several_scales_round_trip():
    two = WeightFormat(SCHEMES["int8_channel"], ("a", "b"))
    assert WeightFormat.parse(str(two)) == two and str(two) == "int8_channel(@a, @b)"
    assert WeightFormat.from_json(two.to_json()) == two


def test_placement_and_format_refuse_what_they_cannot_mean():
    with pytest.raises(ValueError, match="needs an axis"):
        Placement(Layout.column)
    with pytest.raises(ValueError, match="has no axis"):
        Placement(Layout.replicated, 0)
    with pytest.raises(ValueError, match="unknown quantization scheme"):
        WeightFormat.parse("int3_channel(@s)")
    with pytest.raises(ValueError, match="layouts"):
        Placement.parse("diagonal(0)")
    assert Placement.parse("partial") == Placement(Layout.partial) and str(Placement(Layout.partial)) == "partial"
    with pytest.raises(ValueError, match="has no axis"):
        Placement(Layout.partial, 0)  # whole on rank 0: no axis is split


def with_param(g, name, **changes):
    return g.replace(params={**g.params, name: dataclasses.replace(g.params[name], **changes)})


def test_verifier_rejects_bad_scales():
    g = quantized_mlp()
    with pytest.raises(VerifyError, match=r"scale @up.scale is f32\[31\] plain, int8_channel needs plain f32\[32\]"):
        verify(with_param(g, "up.scale", type=TensorType((31,), DType.f32)))
    with pytest.raises(VerifyError, match="scale @nowhere is not a param"):
        verify(with_param(g, "up", format=WeightFormat(SCHEMES["int8_channel"], ("nowhere",))))
    with pytest.raises(VerifyError, match="needs 1 scale tensor"):
        verify(with_param(g, "up", format=WeightFormat(SCHEMES["int8_channel"], ("up.scale", "down.scale"))))
    with pytest.raises(VerifyError, match=r"mxfp4 scales blocks of 32 values; 30 values a row"):
        verify(with_param(g, "down", type=TensorType((64, 15), DType.u8)))


def test_verifier_rejects_a_format_its_storage_does_not_fit():
    b = GraphBuilder("g")
    b.param("s", TensorType((8,), DType.f32))
    w = b.param("w", TensorType((8, 4), DType.bf16), WeightFormat(SCHEMES["fp8_channel"], ("s",)))
    b.output(w)
    with pytest.raises(VerifyError, match="fp8_channel stores f8e4m3, got bf16"):
        verify(b.build())


def test_verifier_rejects_a_shard_axis_beyond_the_rank():
    g = quantized_mlp()
    with pytest.raises(VerifyError, match=r"placement column\(2\) shards axis 2, beyond its rank 2"):
        verify(with_param(g, "up", placement=Placement(Layout.column, 2)))


def test_linear_reads_a_quantized_weight_as_what_it_encodes():
    b = GraphBuilder("g")
    x = b.input("x", TensorType(("T", 64), DType.bf16))
    b.param("s", TensorType((16, 2), DType.u8))
    w = b.param("w", TensorType((16, 32), DType.u8), WeightFormat(SCHEMES["mxfp4"], ("s",)))
    assert isinstance(b.type_of(w), QuantizedType) and b.type_of(w).logical_shape == (16, 64)
    assert b.type_of(b.op("linear", x, w)) == TensorType(("T", 16), DType.bf16)
    norm = b.param("norm", TensorType((64,), DType.bf16))
    assert b.type_of(b.op("rmsnorm_linear", x, norm, w, eps=1e-5)) == TensorType(("T", 16), DType.bf16)
    # Only inputs declared to take one accept a quantized weight.
    with pytest.raises(IRTypeError, match="rmsnorm: weight is a quantized weight"):
        b.op("rmsnorm", b.input("x16", TensorType(("T", 16), DType.bf16)), b.param(
            "n", TensorType((16,), DType.i8), WeightFormat(SCHEMES["int8_channel"], ("n.s",))), eps=1e-5)


def test_linear_refuses_a_plain_dtype_mismatch():
    b = GraphBuilder("g")
    x = b.input("x", TensorType(("T", 64), DType.bf16))
    w = b.param("w", TensorType((16, 64), DType.i8))
    with pytest.raises(IRTypeError, match="differ in dtype .a weight stored in another dtype needs a quantized format"):
        b.op("linear", x, w)


def test_act_quant_goes_with_a_quantized_weight_and_is_absent_when_unset():
    b = GraphBuilder("g")
    x = b.input("x", TensorType(("T", 64), DType.bf16))
    b.param("w.s", TensorType((16,), DType.f32))
    w = b.param("w", TensorType((16, 64), DType.i8), WeightFormat(SCHEMES["int8_channel"], ("w.s",)))
    plain = b.param("p", TensorType((16, 64), DType.bf16))
    b.output(b.op("linear", x, w, name="y", act_quant="int8_per_token"), b.op("linear", x, plain, name="z"))
    text = print_graph(b.build())
    assert '%y = linear(%x, @w) {act_quant="int8_per_token"} : bf16[T, 16]' in text
    assert "%z = linear(%x, @p) : bf16[T, 16]" in text  # unset: not printed, not passed to kernels
    assert print_graph(parse_graph(text)) == text and print_graph(loads(dumps(parse_graph(text)))) == text
    for act_quant, weight in (("int8_per_token", plain), ("int4_per_group", w)):
        with pytest.raises(IRTypeError, match="needs a quantized weight and one of int8_per_token, fp8_per_token"):
            b.op("linear", x, weight, act_quant=act_quant)
