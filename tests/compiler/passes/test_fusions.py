"""Before/Expected IR tests of the fusion passes and dead-code elimination."""

from kiln.compiler.passes.base import PassContext
from kiln.compiler.passes.dce import eliminate_dead_code
from kiln.compiler.passes.fuse_add_rmsnorm import fuse_add_rmsnorm
from kiln.compiler.passes.fuse_linears import fuse_linears, joined_name
from kiln.compiler.passes.fuse_silu_mul import fuse_silu_mul
from kiln.compiler.recipes import Concat

from .ir_text import dedent, run_pass


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


def test_fuse_linears_qkv():
    ctx = PassContext()
    assert run_pass(fuse_linears, QKV_BEFORE, ctx) == dedent("""
        graph g {
          input %x: f32[T, 8]
          param @a.q_proj.weight: f32[8, 8]
          param @a.q_proj.bias: f32[8]
          param @a.k_proj.weight: f32[4, 8]
          param @a.k_proj.bias: f32[4]
          param @a.v_proj.weight: f32[4, 8]
          param @a.v_proj.bias: f32[4]
          param @a.q_k_v_proj.weight: f32[16, 8]
          param @a.q_k_v_proj.bias: f32[16]
          %q_k_v = linear(%x, @a.q_k_v_proj.weight, @a.q_k_v_proj.bias) : f32[T, 16]
          %q, %k, %v = split(%q_k_v) {sizes=[8, 4, 4]} : f32[T, 8], f32[T, 4], f32[T, 4]
          %s = add(%k, %v) : f32[T, 4]
          return %q, %s
        }
    """)
    assert ctx.recipes == [Concat("a.q_k_v_proj.weight", ("a.q_proj.weight", "a.k_proj.weight", "a.v_proj.weight")),
                           Concat("a.q_k_v_proj.bias", ("a.q_proj.bias", "a.k_proj.bias", "a.v_proj.bias"))]


def test_fuse_linears_joins_only_siblings_with_private_weights_and_matching_biases():
    # v reads q, not x: q and k fuse without it.
    not_siblings = QKV_BEFORE.replace("%v = linear(%x,", "%v = linear(%q,")
    assert run_pass(fuse_linears, not_siblings).splitlines()[8:12] == [
        "  param @a.q_k_proj.weight: f32[12, 8]",
        "  param @a.q_k_proj.bias: f32[12]",
        "  %q_k = linear(%x, @a.q_k_proj.weight, @a.q_k_proj.bias) : f32[T, 12]",
        "  %q, %k = split(%q_k) {sizes=[8, 4]} : f32[T, 8], f32[T, 4]",
    ]
    # k's weight is read by another linear too (a tied weight): it stays.
    shared_weight = QKV_BEFORE.replace("return %q, %s",
                                       "%w = linear(%x, @a.k_proj.weight) : f32[T, 4]\n  return %q, %w")
    assert "%q, %v = split(%q_v) {sizes=[8, 4]}" in run_pass(fuse_linears, shared_weight)
    # v without a bias does not join q and k with theirs.
    no_bias = QKV_BEFORE.replace("linear(%x, @a.v_proj.weight, @a.v_proj.bias)", "linear(%x, @a.v_proj.weight)")
    assert "%q, %k = split(%q_k) {sizes=[8, 4]}" in run_pass(fuse_linears, no_bias)
    alone = QKV_BEFORE.replace("%k = linear(%x,", "%k = linear(%q,").replace("%v = linear(%x,", "%v = linear(%q,")
    assert run_pass(fuse_linears, alone).count("split") == 1


def test_fuse_linears_joins_quantized_weights_with_their_scales():
    before = dedent("""
        graph g {
          input %x: f32[T, 8]
          param @m.gate_scale: f32[6]
          param @m.gate: i8[6, 8] format=int8_channel(@m.gate_scale)
          param @m.up_scale: f32[6]
          param @m.up: i8[6, 8] format=int8_channel(@m.up_scale)
          param @m.plain: f32[6, 8]
          %g = linear(%x, @m.gate) : f32[T, 6]
          %u = linear(%x, @m.up) : f32[T, 6]
          %p = linear(%x, @m.plain) : f32[T, 6]
          %gu = mul(%g, %u) : f32[T, 6]
          %y = mul(%gu, %p) : f32[T, 6]
          return %y
        }
    """)
    ctx = PassContext()
    after = run_pass(fuse_linears, before, ctx)
    assert after.splitlines()[7:11] == [
        "  param @m.gate_up: i8[12, 8] format=int8_channel(@m.gate_up_scale)",
        "  param @m.gate_up_scale: f32[12]",
        "  %g_u = linear(%x, @m.gate_up) : f32[T, 12]",
        "  %g, %u = split(%g_u) {sizes=[6, 6]} : f32[T, 6], f32[T, 6]",
    ]
    assert "%p = linear(%x, @m.plain)" in after  # plain: no sibling of the int8 pair
    assert ctx.recipes == [Concat("m.gate_up", ("m.gate", "m.up")),
                           Concat("m.gate_up_scale", ("m.gate_scale", "m.up_scale"))]


def test_joined_names_keep_shared_words_once():
    taken = {"l0.q_k"}
    assert joined_name(["a.q_proj.weight", "a.k_proj.weight", "a.v_proj.weight"], taken) == "a.q_k_v_proj.weight"
    assert joined_name(["m.gate_proj.weight", "m.up_proj.weight"], taken) == "m.gate_up_proj.weight"
    assert joined_name(["l0.q", "l0.k"], taken) == "l0.q_k.1"
    assert joined_name(["l0.q", "l0.k"], taken) == "l0.q_k.2"


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


def test_fuse_linears_gate_up_then_silu_mul():
    fused = run_pass(fuse_linears, GATE_UP_BEFORE)
    assert fused == dedent("""
        graph g {
          input %x: f32[T, 8]
          param @m.gate_proj.weight: f32[6, 8]
          param @m.up_proj.weight: f32[6, 8]
          param @m.gate_up_proj.weight: f32[12, 8]
          %g_u = linear(%x, @m.gate_up_proj.weight) : f32[T, 12]
          %g, %u = split(%g_u) {sizes=[6, 6]} : f32[T, 6], f32[T, 6]
          %a = silu(%g) : f32[T, 6]
          %m = mul(%a, %u) : f32[T, 6]
          return %m
        }
    """)
    assert run_pass(fuse_silu_mul, fused) == dedent("""
        graph g {
          input %x: f32[T, 8]
          param @m.gate_proj.weight: f32[6, 8]
          param @m.up_proj.weight: f32[6, 8]
          param @m.gate_up_proj.weight: f32[12, 8]
          %g_u = linear(%x, @m.gate_up_proj.weight) : f32[T, 12]
          %g, %u = split(%g_u) {sizes=[6, 6]} : f32[T, 6], f32[T, 6]
          %m = silu_mul(%g, %u) : f32[T, 6]
          return %m
        }
    """)


def test_silu_mul_keeps_silu_read_elsewhere():
    before = GATE_UP_BEFORE.replace("return %m", "return %m, %a")
    assert run_pass(fuse_silu_mul, before) == before


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
    assert run_pass(fuse_add_rmsnorm, before) == dedent("""
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
    assert run_pass(eliminate_dead_code, before) == dedent("""
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
    assert run_pass(eliminate_dead_code, before) == dedent("""
        graph g {
          input %x: f32[T, 8]
          param @w.scale: f32[4]
          param @w: i8[4, 8] format=int8_channel(@w.scale)
          %y = linear(%x, @w) : f32[T, 4]
          return %y
        }
    """)


def test_fuse_linears_joins_shards_of_one_placement_only():
    sharded = (QKV_BEFORE.replace("f32[8, 8]\n", "f32[8, 8] placement=column(0)\n")
               .replace("@a.q_proj.bias: f32[8]", "@a.q_proj.bias: f32[8] placement=column(0)")
               .replace("@a.k_proj.weight: f32[4, 8]", "@a.k_proj.weight: f32[4, 8] placement=column(0)")
               .replace("@a.k_proj.bias: f32[4]", "@a.k_proj.bias: f32[4] placement=column(0)"))
    text = run_pass(fuse_linears, sharded)
    assert "param @a.q_k_proj.weight: f32[12, 8] placement=column(0)" in text
    assert "param @a.q_k_proj.bias: f32[12] placement=column(0)" in text
    assert "%v = linear(%x, @a.v_proj.weight, @a.v_proj.bias)" in text  # replicated: not joined to the shards
