"""Before/Expected IR test of fuse_router_count (a router and its layer's load counter, as
count_expert_load leaves them), and a router without a counter left alone."""

from kiln.compiler.passes.fuse_router_count import fuse_router_count

from .ir_text import dedent, run_pass

BEFORE = dedent("""
    graph g {
      input %slots: i32[T]
      input %expert_load.0: i64[4]
      input %x: f32[T, 8]
      param @l0.mlp.gate.weight: f32[4, 8]
      %l0.router = linear(%x, @l0.mlp.gate.weight) : f32[T, 4]
      %l0.route_w, %l0.route_ids = router_topk(%l0.router) {renormalize=true, scoring="softmax", top_k=2} : f32[T, 2], i32[T, 2]
      %expert_load.0.counted = count_experts(%expert_load.0, %l0.route_ids, %slots) : i64[4]
      return %l0.route_w
    }
""")
EXPECTED = dedent("""
    graph g {
      input %slots: i32[T]
      input %expert_load.0: i64[4]
      input %x: f32[T, 8]
      param @l0.mlp.gate.weight: f32[4, 8]
      %l0.router = linear(%x, @l0.mlp.gate.weight) : f32[T, 4]
      %l0.route_w, %l0.route_ids, %expert_load.0.counted = router_topk_count(%l0.router, %expert_load.0, %slots) {renormalize=true, scoring="softmax", top_k=2} : f32[T, 2], i32[T, 2], i64[4]
      return %l0.route_w
    }
""")


def test_fuse_router_count():
    assert run_pass(fuse_router_count, BEFORE) == EXPECTED


def test_a_router_without_a_counter_is_left_alone():
    uncounted = BEFORE.replace("  %expert_load.0.counted = count_experts(%expert_load.0, %l0.route_ids, %slots) : i64[4]\n", "")
    assert run_pass(fuse_router_count, uncounted) == uncounted
