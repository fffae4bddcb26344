"""Before/Expected IR tests of insert_lora: one grouping of the step's rows by adapter, read by hooks on the
targeted GEMMs (a shrink before the GEMM, an expand after it), per slice of a fused one."""

import pytest

from kiln.compiler.passes.base import PassContext
from kiln.compiler.passes.insert_lora import insert_lora
from kiln.compiler.recipes import Concat
from kiln.lora_layout import LoraLayout, LoraSlice

from .ir_text import dedent, run_pass

BEFORE = dedent("""
    graph g {
      input %x: f32[T, 8]
      input %lora_slot: i32[B]
      input %q_start: i32[B]
      input %q_len: i32[B]
      param @l.q_k_proj.weight: f32[12, 8]
      param @l.o_proj.weight: f32[8, 8]
      %q_k = linear(%x, @l.q_k_proj.weight) : f32[T, 12]
      %q, %k = split(%q_k) {sizes=[8, 4]} : f32[T, 8], f32[T, 4]
      %h = linear_residual(%q, @l.o_proj.weight, %x) : f32[T, 8]
      return %h, %k
    }
""")

EXPECTED = dedent("""
    graph g {
      input %x: f32[T, 8]
      input %lora_slot: i32[B]
      input %q_start: i32[B]
      input %q_len: i32[B]
      input %lora_a.l.q_k_proj: f32[3, 8, 8]
      input %lora_b.l.q_k_proj: f32[3, 12, 4]
      input %lora_a.l.o_proj: f32[3, 4, 8]
      input %lora_b.l.o_proj: f32[3, 8, 4]
      param @l.q_k_proj.weight: f32[12, 8]
      param @l.o_proj.weight: f32[8, 8]
      %lora_rows, %lora_tiles = lora_groups(%lora_slot, %q_start, %q_len) {slots=3} : i32[T, 16], i32[T]
      %q_k.lora_h = lora_shrink(%x, %lora_a.l.q_k_proj, %lora_rows, %lora_tiles) : f32[T, 8]
      %q_k.base = linear(%x, @l.q_k_proj.weight) : f32[T, 12]
      %q_k = lora_expand(%q_k.base, %q_k.lora_h, %lora_b.l.q_k_proj, %lora_rows, %lora_tiles) {slices=[8, 4]} : f32[T, 12]
      %q, %k = split(%q_k) {sizes=[8, 4]} : f32[T, 8], f32[T, 4]
      %h.lora_h = lora_shrink(%q, %lora_a.l.o_proj, %lora_rows, %lora_tiles) : f32[T, 4]
      %h.base = linear_residual(%q, @l.o_proj.weight, %x) : f32[T, 8]
      %h = lora_expand(%h.base, %h.lora_h, %lora_b.l.o_proj, %lora_rows, %lora_tiles) {slices=[8]} : f32[T, 8]
      return %h, %k
    }
""")

FUSED = Concat("l.q_k_proj.weight", ("l.q_proj.weight", "l.k_proj.weight"))


def _ctx(*targets: str) -> PassContext:
    return PassContext(recipes=[FUSED], lora=LoraLayout(3, 4, targets, ()))


def test_hooks_every_targeted_gemm_and_each_slice_of_a_fused_one():
    ctx = _ctx("q_proj", "k_proj", "o_proj")
    assert run_pass(insert_lora, BEFORE, ctx) == EXPECTED
    assert [h.slices for h in ctx.lora.hooks] == [
        (LoraSlice("l.q_proj", 8, 8), LoraSlice("l.k_proj", 8, 4)), (LoraSlice("l.o_proj", 8, 8),)]


def test_a_fused_gemm_with_one_targeted_member_gets_a_hook_on_all_its_slices():
    ctx = _ctx("k_proj")
    after = run_pass(insert_lora, BEFORE, ctx)
    assert "lora_expand(%q_k.base" in after and "%h.base" not in after
    assert [h.a_input for h in ctx.lora.hooks] == ["lora_a.l.q_k_proj"]


def test_without_lora_the_graph_is_unchanged():
    assert run_pass(insert_lora, BEFORE, PassContext()) == BEFORE


def test_no_targets_matched_leaves_the_graph_and_records_no_hooks():
    ctx = _ctx("down_proj")
    assert run_pass(insert_lora, BEFORE, ctx) == BEFORE
    assert ctx.lora.hooks == ()


def test_compile_options_refuse_unknown_targets_and_tp():
    from kiln.compiler.options import CompileOptions

    with pytest.raises(ValueError, match="lm_head; supported: q_proj"):
        CompileOptions(max_loras=2, lora_target_modules=("lm_head",)).validate()
    with pytest.raises(ValueError, match="tensor parallelism"):
        CompileOptions(max_loras=2, tp=2).validate()
    assert "lora_slot" in CompileOptions(max_loras=1).step_schema().names
    assert "lora_slot" not in CompileOptions().step_schema().names


PROLOGUE_BEFORE = dedent("""
    graph g {
      input %h: f32[T, 8]
      input %lora_slot: i32[B]
      input %q_start: i32[B]
      input %q_len: i32[B]
      param @l.norm: f32[8]
      param @l.gate_up_proj.weight: f32[12, 8]
      param @l.down_proj.weight: f32[8, 6]
      %n = rmsnorm(%h, @l.norm) {eps=1e-05} : f32[T, 8]
      %gu = linear(%n, @l.gate_up_proj.weight) : f32[T, 12]
      %g, %u = split(%gu) {sizes=[6, 6]} : f32[T, 6], f32[T, 6]
      %m = silu_mul(%g, %u) : f32[T, 6]
      %d = linear_residual(%m, @l.down_proj.weight, %h) : f32[T, 8]
      return %d
    }
""")

PROLOGUE_EXPECTED = dedent("""
    graph g {
      input %h: f32[T, 8]
      input %lora_slot: i32[B]
      input %q_start: i32[B]
      input %q_len: i32[B]
      input %lora_a.l.gate_up_proj: f32[3, 8, 8]
      input %lora_b.l.gate_up_proj: f32[3, 12, 4]
      input %lora_a.l.down_proj: f32[3, 4, 6]
      input %lora_b.l.down_proj: f32[3, 8, 4]
      param @l.norm: f32[8]
      param @l.gate_up_proj.weight: f32[12, 8]
      param @l.down_proj.weight: f32[8, 6]
      %n = rmsnorm(%h, @l.norm) {eps=1e-05} : f32[T, 8]
      %lora_rows, %lora_tiles = lora_groups(%lora_slot, %q_start, %q_len) {slots=3} : i32[T, 16], i32[T]
      %gu.lora_h = lora_shrink(%h, %lora_a.l.gate_up_proj, %lora_rows, %lora_tiles, @l.norm) {eps=1e-05, prologue="rmsnorm"} : f32[T, 8]
      %gu.base = linear(%n, @l.gate_up_proj.weight) : f32[T, 12]
      %gu = lora_expand(%gu.base, %gu.lora_h, %lora_b.l.gate_up_proj, %lora_rows, %lora_tiles) {slices=[6, 6]} : f32[T, 12]
      %g, %u = split(%gu) {sizes=[6, 6]} : f32[T, 6], f32[T, 6]
      %m = silu_mul(%g, %u) : f32[T, 6]
      %d.lora_h = lora_shrink(%gu, %lora_a.l.down_proj, %lora_rows, %lora_tiles) {prologue="silu_mul"} : f32[T, 4]
      %d.base = linear_residual(%m, @l.down_proj.weight, %h) : f32[T, 8]
      %d = lora_expand(%d.base, %d.lora_h, %lora_b.l.down_proj, %lora_rows, %lora_tiles) {slices=[8]} : f32[T, 8]
      return %d
    }
""")


def test_hooks_read_the_norm_or_activation_input_so_those_still_join_their_gemms():
    fused = Concat("l.gate_up_proj.weight", ("l.gate_proj.weight", "l.up_proj.weight"))
    ctx = PassContext(recipes=[fused], lora=LoraLayout(3, 4, ("gate_proj", "up_proj", "down_proj"), ()))
    assert run_pass(insert_lora, PROLOGUE_BEFORE, ctx) == PROLOGUE_EXPECTED
