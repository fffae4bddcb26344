"""Before/Expected IR tests of the fusion passes and dead-code elimination."""

import textwrap

from kiln.compiler.passes.base import PassContext
from kiln.compiler.recipes import Concat
from kiln.compiler.passes.dce import eliminate_dead_code
from kiln.compiler.passes.fuse_add_rmsnorm import fuse_add_rmsnorm
from kiln.compiler.passes.fuse_linears import fuse_gate_up, fuse_qkv
from kiln.compiler.passes.fuse_silu_mul import fuse_silu_mul
from kiln.ir import parse_graph, print_graph, verify


def run(pass_fn, before: str, ctx: PassContext | None = None) -> str:
    graph = parse_graph(before)
    verify(graph)
    after = pass_fn(graph, ctx or PassContext())
    verify(after)
    return print_graph(after)


def dedent(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


QKV_BEFORE = dedent("""
    graph g {
      input %x: f32[T, 8]
      param @a.q_proj.weight: f32[8, 8]
      param @a.q_proj.bias: f32[8]
      param @a.k_proj.weight: f32[4, 8]
      param @a.k_proj.bias: f32[4]
      param @a.v_proj.weight: f32[4, 8]
      param @a.v_proj.bias: f32[4]
      %q = linear(%x, @a.q_proj.weight, @a.q_proj.bias) : f32[T, 8]
      %k = linear(%x, @a.k_proj.weight, @a.k_proj.bias) : f32[T, 4]
      %v = linear(%x, @a.v_proj.weight, @a.v_proj.bias) : f32[T, 4]
      %s = add(%k, %v) : f32[T, 4]
      return %q, %s
    }
""")


def test_fuse_qkv():
    ctx = PassContext()
    assert run(fuse_qkv, QKV_BEFORE, ctx) == dedent("""
        graph g {
          input %x: f32[T, 8]
          param @a.q_proj.weight: f32[8, 8]
          param @a.q_proj.bias: f32[8]
          param @a.k_proj.weight: f32[4, 8]
          param @a.k_proj.bias: f32[4]
          param @a.v_proj.weight: f32[4, 8]
          param @a.v_proj.bias: f32[4]
          param @a.qkv_proj.weight: f32[16, 8]
          param @a.qkv_proj.bias: f32[16]
          %q.qkv_proj = linear(%x, @a.qkv_proj.weight, @a.qkv_proj.bias) : f32[T, 16]
          %q, %k, %v = split(%q.qkv_proj) {sizes=[8, 4, 4]} : f32[T, 8], f32[T, 4], f32[T, 4]
          %s = add(%k, %v) : f32[T, 4]
          return %q, %s
        }
    """)
    assert ctx.recipes == [Concat("a.qkv_proj.weight", ("a.q_proj.weight", "a.k_proj.weight", "a.v_proj.weight")),
                           Concat("a.qkv_proj.bias", ("a.q_proj.bias", "a.k_proj.bias", "a.v_proj.bias"))]


def test_fuse_qkv_leaves_incomplete_or_shared_groups():
    not_siblings = QKV_BEFORE.replace("%v = linear(%x,", "%v = linear(%q,")
    assert run(fuse_qkv, not_siblings) == not_siblings
    shared_weight = QKV_BEFORE.replace("return %q, %s", "%w = linear(%x, @a.k_proj.weight) : f32[T, 4]\n  return %q, %w")
    assert run(fuse_qkv, shared_weight) == shared_weight


GATE_UP_BEFORE = dedent("""
    graph g {
      input %x: f32[T, 8]
      param @m.gate_proj.weight: f32[6, 8]
      param @m.up_proj.weight: f32[6, 8]
      %g = linear(%x, @m.gate_proj.weight) : f32[T, 6]
      %u = linear(%x, @m.up_proj.weight) : f32[T, 6]
      %a = silu(%g) : f32[T, 6]
      %m = mul(%a, %u) : f32[T, 6]
      return %m
    }
""")


def test_fuse_gate_up_then_silu_mul():
    fused = run(fuse_gate_up, GATE_UP_BEFORE)
    assert fused == dedent("""
        graph g {
          input %x: f32[T, 8]
          param @m.gate_proj.weight: f32[6, 8]
          param @m.up_proj.weight: f32[6, 8]
          param @m.gate_up_proj.weight: f32[12, 8]
          %g.gate_up_proj = linear(%x, @m.gate_up_proj.weight) : f32[T, 12]
          %g, %u = split(%g.gate_up_proj) {sizes=[6, 6]} : f32[T, 6], f32[T, 6]
          %a = silu(%g) : f32[T, 6]
          %m = mul(%a, %u) : f32[T, 6]
          return %m
        }
    """)
    assert run(fuse_silu_mul, fused) == dedent("""
        graph g {
          input %x: f32[T, 8]
          param @m.gate_proj.weight: f32[6, 8]
          param @m.up_proj.weight: f32[6, 8]
          param @m.gate_up_proj.weight: f32[12, 8]
          %g.gate_up_proj = linear(%x, @m.gate_up_proj.weight) : f32[T, 12]
          %g, %u = split(%g.gate_up_proj) {sizes=[6, 6]} : f32[T, 6], f32[T, 6]
          %m = silu_mul(%g, %u) : f32[T, 6]
          return %m
        }
    """)


def test_silu_mul_keeps_silu_read_elsewhere():
    before = GATE_UP_BEFORE.replace("return %m", "return %m, %a")
    assert run(fuse_silu_mul, before) == before


def test_fuse_add_rmsnorm_keeps_sum_for_later_readers():
    before = dedent("""
        graph g {
          input %h: f32[T, 8]
          input %o: f32[T, 8]
          param @w: f32[8]
          %s = add(%h, %o) : f32[T, 8]
          %y = rmsnorm(%s, @w) {eps=1e-06} : f32[T, 8]
          %z = add(%s, %y) : f32[T, 8]
          return %z
        }
    """)
    assert run(fuse_add_rmsnorm, before) == dedent("""
        graph g {
          input %h: f32[T, 8]
          input %o: f32[T, 8]
          param @w: f32[8]
          %y, %s = add_rmsnorm(%h, %o, @w) {eps=1e-06} : f32[T, 8], f32[T, 8]
          %z = add(%s, %y) : f32[T, 8]
          return %z
        }
    """)


def test_dce_drops_unread_nodes_and_params_but_keeps_effects():
    before = dedent("""
        graph g {
          input %x: f32[T, 2, 4]
          input %kc: f32[NS, 2, 4]
          input %vc: f32[NS, 2, 4]
          input %slots: i32[T]
          param @unused: f32[4]
          param @w: f32[4]
          %dead = rmsnorm(%x, @unused) {eps=1e-06} : f32[T, 2, 4]
          %k2, %v2 = kv_store(%kc, %vc, %x, %x, %slots) : f32[NS, 2, 4], f32[NS, 2, 4]
          %y = rmsnorm(%x, @w) {eps=1e-06} : f32[T, 2, 4]
          return %y
        }
    """)
    assert run(eliminate_dead_code, before) == dedent("""
        graph g {
          input %x: f32[T, 2, 4]
          input %kc: f32[NS, 2, 4]
          input %vc: f32[NS, 2, 4]
          input %slots: i32[T]
          param @w: f32[4]
          %k2, %v2 = kv_store(%kc, %vc, %x, %x, %slots) : f32[NS, 2, 4], f32[NS, 2, 4]
          %y = rmsnorm(%x, @w) {eps=1e-06} : f32[T, 2, 4]
          return %y
        }
    """)


def test_dce_keeps_the_scales_of_a_live_quantized_weight():
    before = dedent("""
        graph g {
          input %x: f32[T, 8]
          param @w.scale: f32[4]
          param @w: i8[4, 8] format=int8_channel(@w.scale)
          param @dead.scale: f32[4]
          param @dead: i8[4, 8] format=int8_channel(@dead.scale)
          %y = linear(%x, @w) : f32[T, 4]
          return %y
        }
    """)
    assert run(eliminate_dead_code, before) == dedent("""
        graph g {
          input %x: f32[T, 8]
          param @w.scale: f32[4]
          param @w: i8[4, 8] format=int8_channel(@w.scale)
          %y = linear(%x, @w) : f32[T, 4]
          return %y
        }
    """)
