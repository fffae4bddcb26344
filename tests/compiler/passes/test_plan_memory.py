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
