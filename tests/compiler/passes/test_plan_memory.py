"""Memory planning: reuse across disjoint lifetimes, views sharing their root, outputs kept to the end."""

import textwrap

from kiln.compiler.passes.base import PassContext
from kiln.compiler.passes.plan_memory import ALIGNMENT, plan_memory
from kiln.ir import parse_graph

GRAPH = textwrap.dedent("""
    graph g {
      input %x: f32[T, 64]
      param @w: f32[64]
      %a = rmsnorm(%x, @w) {eps=1e-06} : f32[T, 64]
      %b = rmsnorm(%a, @w) {eps=1e-06} : f32[T, 64]
      %v = reshape(%b) {shape=["T", 2, 32]} : f32[T, 2, 32]
      %c = rmsnorm(%b, @w) {eps=1e-06} : f32[T, 64]
      %d = rmsnorm(%c, @w) {eps=1e-06} : f32[T, 64]
      %e = rmsnorm(%v, @w2) {eps=1e-06} : f32[T, 2, 32]
      return %d, %e
    }
""").replace("param @w: f32[64]", "param @w: f32[64]\n  param @w2: f32[32]")


def plan(bounds):
    ctx = PassContext(symbol_bounds=bounds)
    plan_memory(parse_graph(GRAPH), ctx)
    return ctx.memory_plan


def overlap(p, x, y, size):
    ox, oy = p.offsets[p.roots[x]], p.offsets[p.roots[y]]
    return ox < oy + size and oy < ox + size


def test_disjoint_lifetimes_share_and_live_ones_do_not():
    p = plan({"T": 4})
    size = 4 * 64 * 4
    assert size % ALIGNMENT == 0
    # a dies when b is made; c may take a's place; b stays alive through its view until e.
    assert p.roots["v"] == "b"
    assert not overlap(p, "a", "b", size)
    assert not overlap(p, "b", "c", size) and not overlap(p, "b", "d", size) and not overlap(p, "b", "e", size)
    assert not overlap(p, "d", "e", size)  # both graph outputs
    assert p.offsets["c"] == p.offsets["a"]
    # At most three buffers are live at once (b, c, d; then b, d, e): the arena is that big, no more.
    assert p.arena_bytes == 3 * size


def test_sizes_follow_the_symbol_bounds():
    assert plan({"T": 8}).arena_bytes == 2 * plan({"T": 4}).arena_bytes


# A residual stream through two linear_residuals (o and down projections of a layer).
RESIDUAL_CHAIN = textwrap.dedent("""
    graph g {
      input %x: f32[T, 64]
      param @w: f32[64]
      param @wo: f32[64, 64]
      %h = rmsnorm(%x, @w) {eps=1e-06} : f32[T, 64]
      %a = rmsnorm(%h, @w) {eps=1e-06} : f32[T, 64]
      %h1 = linear_residual(%a, @wo, %h) : f32[T, 64]
      %b = rmsnorm(%h1, @w) {eps=1e-06} : f32[T, 64]
      %h2 = linear_residual(%b, @wo, %h1) : f32[T, 64]
      %y = rmsnorm(%h2, @w) {eps=1e-06} : f32[T, 64]
      return %y
    }
""")


def plan_text(text: str, bounds=None):
    ctx = PassContext(symbol_bounds=bounds or {"T": 4})
    plan_memory(parse_graph(text), ctx)
    return ctx.memory_plan


def test_linear_residual_takes_over_the_residual_it_reads_last():
    p = plan_text(RESIDUAL_CHAIN)
    # h1 and h2 are h's storage: no copy of the residual into a fresh output, and h lives until y reads h2.
    assert p.roots["h1"] == "h" and p.roots["h2"] == "h"
    assert set(p.offsets) == {"h", "a", "b", "y"}
    size = 4 * 64 * 4
    assert not overlap(p, "h2", "b", size) and not overlap(p, "h1", "a", size)


def test_a_residual_read_later_keeps_its_storage():
    # h is read again after h1 is made: h1 needs storage of its own.
    text = RESIDUAL_CHAIN.replace("%b = rmsnorm(%h1, @w)", "%b = rmsnorm(%h, @w)")
    p = plan_text(text)
    assert p.roots["h1"] == "h1" and p.roots["h2"] == "h1"
    assert not overlap(p, "h", "h1", 4 * 64 * 4)


def test_no_takeover_of_a_view_an_output_a_graph_input_or_an_operand():
    view = RESIDUAL_CHAIN.replace(
        "%h1 = linear_residual(%a, @wo, %h)",
        '%hv = reshape(%h) {shape=["T", 64]} : f32[T, 64]\n  %h1 = linear_residual(%a, @wo, %hv)')
    assert plan_text(view).roots["h1"] == "h1"  # a view need not span its root whole
    returned = RESIDUAL_CHAIN.replace("return %y", "return %y, %h1")
    assert plan_text(returned).roots["h2"] == "h2"  # h1 lives to the end
    from_input = RESIDUAL_CHAIN.replace("linear_residual(%a, @wo, %h)", "linear_residual(%a, @wo, %x)")
    assert plan_text(from_input).roots["h1"] == "h1"  # the step's inputs are not the arena's
    operand = RESIDUAL_CHAIN.replace("linear_residual(%a, @wo, %h)", "linear_residual(%h, @wo, %h)")
    assert plan_text(operand).roots["h1"] == "h1"  # x is read while the output is written


# A LoRA hook whose shrink (a side-stream op) is the last reader of %a in program order: the GEMM
# after it runs while the shrink may still read %a.
SIDE_STREAM = textwrap.dedent("""
    graph g {
      input %x: f32[T, 64]
      input %lora_a: f32[2, 16, 64]
      input %lora_b: f32[2, 64, 16]
      input %rows: i32[T, 16]
      input %tiles: i32[T]
      param @w: f32[64]
      param @wo: f32[64, 64]
      %a = rmsnorm(%x, @w) {eps=1e-06} : f32[T, 64]
      %n = rmsnorm(%a, @w) {eps=1e-06} : f32[T, 64]
      %y.lora_h = lora_shrink(%a, %lora_a, %rows, %tiles) : f32[T, 16]
      %y.base = linear(%n, @wo) : f32[T, 64]
      %y = lora_expand(%y.base, %y.lora_h, %lora_b, %rows, %tiles) {slices=[64]} : f32[T, 64]
      return %y
    }
""")


def test_a_side_stream_ops_operands_live_until_its_join():
    p = plan_text(SIDE_STREAM)
    size = 4 * 64 * 4
    # Without the side stream %y.base could take %a's storage (its last reader is the shrink).
    assert not overlap(p, "a", "y.base", size)
    assert not overlap(p, "y.lora_h", "y.base", 4 * 16 * 4)
    in_order = SIDE_STREAM.replace("%y.lora_h = lora_shrink(%a,", "%y.lora_h = lora_shrink(%n,")
    assert overlap(plan_text(in_order), "a", "y.base", size)  # (%a dead once %n is made: shared)
