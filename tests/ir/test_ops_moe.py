"""The mixture-of-experts ops: type inference, their refusals, and the printer/parser round trip."""

import pytest

from kiln.ir import DType, GraphBuilder, IRTypeError, TensorType, parse_graph, print_graph, verify
from kiln.ir.serialize import dumps, loads

E, H, I, K = 8, 64, 48, 2


def moe_graph(top_k: int = K, **moe_attrs):
    """A sparse MoE block with a Qwen2-MoE shared expert gate, as the model files write it."""
    b = GraphBuilder("moe_block")
    x = b.input("x", TensorType(("T", H), DType.bf16))
    router = b.param("router", TensorType((E, H), DType.bf16))
    gate_up = b.param("experts.gate_up", TensorType((E, 2 * I, H), DType.bf16))
    down = b.param("experts.down", TensorType((E, H, I), DType.bf16))
    shared_gate = b.param("shared_gate", TensorType((1, H), DType.bf16))
    logits = b.op("linear", x, router, name="router_logits")
    weights, ids = b.op("router_topk", logits, top_k=top_k, renormalize=True, names=("route_w", "route_ids"))
    routed = b.op("moe", x, weights, ids, gate_up, down, name="routed", **moe_attrs)
    gate = b.op("sigmoid", b.op("linear", x, shared_gate, name="shared_logit"), name="shared_gate_p")
    b.output(b.op("scale_rows", routed, gate, name="scaled"))
    return b.build()


def test_types_and_round_trip():
    g = moe_graph()
    verify(g)
    text = print_graph(g)
    assert "%route_w, %route_ids = router_topk(%router_logits) {renormalize=true, scoring=\"softmax\", top_k=2} " \
           ": f32[T, 2], i32[T, 2]" in text
    assert "%routed = moe(%x, %route_w, %route_ids, @experts.gate_up, @experts.down) {expert_offset=0} " \
           ": bf16[T, 64]" in text
    assert "%scaled = scale_rows(%routed, %shared_gate_p) : bf16[T, 64]" in text
    assert parse_graph(text) == g
    assert loads(dumps(g)) == g


def test_expert_offset_is_kept():
    assert "{expert_offset=4}" in print_graph(moe_graph(expert_offset=4))


def test_refusals():
    with pytest.raises(IRTypeError, match=r"top_k=9 must be in 1..8"):
        moe_graph(top_k=9)
    b = GraphBuilder("bad")
    logits = b.input("logits", TensorType(("T", E), DType.f32))
    with pytest.raises(IRTypeError, match="scoring 'sigmoid' is not supported; supported: softmax"):
        b.op("router_topk", logits, top_k=2, scoring="sigmoid")
    x = b.input("x", TensorType(("T", H), DType.bf16))
    w, ids = b.op("router_topk", logits, top_k=2)
    gate_up = b.param("gu", TensorType((E, 2 * I, H), DType.bf16))
    with pytest.raises(IRTypeError, match=r"w_down .* must be \[E, H, I\]"):
        b.op("moe", x, w, ids, gate_up, b.param("d", TensorType((E, H, I + 1), DType.bf16)))
    with pytest.raises(IRTypeError, match="even, static second dim"):
        b.op("moe", x, w, ids, b.param("odd", TensorType((E, 2 * I + 1, H), DType.bf16)),
             b.param("d2", TensorType((E, H, I), DType.bf16)))
    with pytest.raises(IRTypeError, match="must be f32 and match ids"):
        b.op("moe", x, b.input("w16", TensorType(("T", 2), DType.bf16)), ids, gate_up,
             b.param("d3", TensorType((E, H, I), DType.bf16)))
    with pytest.raises(IRTypeError, match=r"must be \[rows, 1\]"):
        b.op("scale_rows", x, x)


def test_moe_residual_types_as_moe_and_refuses_another_residual():
    b = GraphBuilder("fused")
    x = b.input("x", TensorType(("T", H), DType.bf16))
    w, ids = b.op("router_topk", b.input("logits", TensorType(("T", E), DType.f32)), top_k=K, names=("w", "ids"))
    gate_up = b.param("gu", TensorType((E, 2 * I, H), DType.bf16))
    down = b.param("d", TensorType((E, H, I), DType.bf16))
    out = b.op("moe_residual", x, w, ids, gate_up, down, x, name="out")
    b.output(out)
    assert "%out = moe_residual(%x, %w, %ids, @gu, @d, %x) {expert_offset=0} : bf16[T, 64]" in print_graph(b.build())
    with pytest.raises(IRTypeError, match="residual .* must be the experts' output type"):
        b.op("moe_residual", x, w, ids, gate_up, down, b.input("r32", TensorType(("T", H), DType.f32)))
