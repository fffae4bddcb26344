"""Before/Expected IR tests of the quantize pass, and the quantization registry's refusals."""

import pytest

from kiln.compiler.options import CompileOptions
from kiln.compiler.passes.base import PassContext
from kiln.compiler.passes.quantize import quantize
from kiln.compiler.quantization import get_method
from kiln.compiler.recipes import Quantize
from kiln.ir import WeightFormat
from kiln.ir.weights import SCHEMES

from .ir_text import dedent, run_pass

# A fused layer with a tied lm_head: the embedding's table is also the last GEMM's weight.
BEFORE = dedent("""
    graph g {
      input %ids: i32[T]
      param @emb: f32[40, 32]
      param @ln1: f32[32]
      param @wqkv: f32[96, 32]
      param @wo: f32[32, 64]
      param @wgu: f32[128, 32]
      param @wd: f32[32, 64]
      %h = embedding(%ids, @emb) : f32[T, 32]
      %qkv = rmsnorm_linear(%h, @ln1, @wqkv) {eps=1e-05} : f32[T, 96]
      %q, %kv = split(%qkv) {sizes=[64, 32]} : f32[T, 64], f32[T, 32]
      %r1 = linear_residual(%q, @wo, %h) : f32[T, 32]
      %gu = linear(%r1, @wgu) : f32[T, 128]
      %r2 = silu_mul_linear_residual(%gu, @wd, %r1) : f32[T, 32]
      %logits = linear(%r2, @emb) : f32[T, 40]
      return %logits
    }
""")

# BEFORE with an lm_head of its own, as the models build it: the final norm joined to the head, then a
# cast of its output to f32.
UNTIED = BEFORE.replace("param @ln1: f32[32]", "param @ln1: f32[32]\n  param @head: f32[40, 32]").replace(
    "%logits = linear(%r2, @emb) : f32[T, 40]",
    "%lm = rmsnorm_linear(%r2, @ln1, @head) {eps=1e-05} : f32[T, 40]\n  %logits = cast(%lm) {dtype=\"f32\"} : f32[T, 40]")

EXPECTED_W8A8 = dedent("""
    graph g {
      input %ids: i32[T]
      param @emb: f32[40, 32]
      param @ln1: f32[32]
      param @wqkv.q: i8[96, 32] format=int8_channel(@wqkv.q.scale)
      param @wqkv.q.scale: f32[96]
      param @wo.q: i8[32, 64] format=int8_channel(@wo.q.scale)
      param @wo.q.scale: f32[32]
      param @wgu.q: i8[128, 32] format=int8_channel(@wgu.q.scale)
      param @wgu.q.scale: f32[128]
      param @wd.q: i8[32, 64] format=int8_channel(@wd.q.scale)
      param @wd.q.scale: f32[32]
      %h = embedding(%ids, @emb) : f32[T, 32]
      %qkv = rmsnorm_linear(%h, @ln1, @wqkv.q) {act_quant="int8_per_token", eps=1e-05} : f32[T, 96]
      %q, %kv = split(%qkv) {sizes=[64, 32]} : f32[T, 64], f32[T, 32]
      %r1 = linear_residual(%q, @wo.q, %h) {act_quant="int8_per_token"} : f32[T, 32]
      %gu = linear(%r1, @wgu.q) {act_quant="int8_per_token"} : f32[T, 128]
      %r2 = silu_mul_linear_residual(%gu, @wd.q, %r1) {act_quant="int8_per_token"} : f32[T, 32]
      %logits = linear(%r2, @emb) : f32[T, 40]
      return %logits
    }
""")


def test_w8a8_quantizes_every_gemm_but_the_lm_head():
    ctx = PassContext(quantization=get_method("w8a8_int8"))
    assert run_pass(quantize, BEFORE, ctx) == EXPECTED_W8A8
    assert ctx.recipes == [Quantize(f"{n}.q", n, WeightFormat(SCHEMES["int8_channel"], (f"{n}.q.scale",)))
                           for n in ("wqkv", "wo", "wgu", "wd")]


def test_a_weight_two_gemms_read_is_quantized_once():
    shared = BEFORE.replace("%r2 = silu_mul", "%again = linear(%q, @wo) : f32[T, 32]\n  %r2 = silu_mul")
    ctx = PassContext(quantization=get_method("w8a16_int8"))
    after = run_pass(quantize, shared, ctx)
    assert "%again = linear(%q, @wo.q) : f32[T, 32]" in after and after.count("param @wo.q:") == 1
    assert [r.output for r in ctx.recipes].count("wo.q") == 1


def test_weight_only_methods_set_no_act_quant_and_mxfp4_packs_two_values_a_byte():
    after = run_pass(quantize, BEFORE, PassContext(quantization=get_method("mxfp4")))
    assert "  param @wo.q: u8[32, 32] format=mxfp4(@wo.q.scale)" in after
    assert "  param @wo.q.scale: u8[32, 2]" in after
    assert "  %r1 = linear_residual(%q, @wo.q, %h) : f32[T, 32]" in after
    fp8 = run_pass(quantize, BEFORE, PassContext(quantization=get_method("fp8")))
    assert '%r1 = linear_residual(%q, @wo.q, %h) {act_quant="fp8_per_token"}' in fp8
    assert "param @wo.q: f8e4m3[32, 64] format=fp8_channel(@wo.q.scale)" in fp8


def test_an_untied_lm_head_stays_plain_and_rows_mxfp4_cannot_hold_too():
    after = run_pass(quantize, UNTIED, PassContext(quantization=get_method("fp8")))
    assert "%lm = rmsnorm_linear(%r2, @ln1, @head) {eps=1e-05} : f32[T, 40]" in after
    # 48 in-features are no whole number of MX blocks of 32: @wd stays plain, the rest is quantized.
    odd = BEFORE.replace("@wd: f32[32, 64]", "@wd: f32[32, 48]").replace("@wgu: f32[128, 32]", "@wgu: f32[96, 32]") \
        .replace("%gu = linear(%r1, @wgu) : f32[T, 128]", "%gu = linear(%r1, @wgu) : f32[T, 96]")
    after = run_pass(quantize, odd, PassContext(quantization=get_method("mxfp4")))
    assert "%r2 = silu_mul_linear_residual(%gu, @wd, %r1) : f32[T, 32]" in after
    assert "@wo.q" in after


# quantize_lm_head on the tied BEFORE: the embedding keeps the plain table, the head reads a copy.
EXPECTED_FP8_WITH_HEAD = dedent("""
    graph g {
      input %ids: i32[T]
      param @emb: f32[40, 32]
      param @ln1: f32[32]
      param @wqkv.q: f8e4m3[96, 32] format=fp8_channel(@wqkv.q.scale)
      param @wqkv.q.scale: f32[96]
      param @wo.q: f8e4m3[32, 64] format=fp8_channel(@wo.q.scale)
      param @wo.q.scale: f32[32]
      param @wgu.q: f8e4m3[128, 32] format=fp8_channel(@wgu.q.scale)
      param @wgu.q.scale: f32[128]
      param @wd.q: f8e4m3[32, 64] format=fp8_channel(@wd.q.scale)
      param @wd.q.scale: f32[32]
      param @emb.q: f8e4m3[40, 32] format=fp8_channel(@emb.q.scale)
      param @emb.q.scale: f32[40]
      %h = embedding(%ids, @emb) : f32[T, 32]
      %qkv = rmsnorm_linear(%h, @ln1, @wqkv.q) {act_quant="fp8_per_token", eps=1e-05} : f32[T, 96]
      %q, %kv = split(%qkv) {sizes=[64, 32]} : f32[T, 64], f32[T, 32]
      %r1 = linear_residual(%q, @wo.q, %h) {act_quant="fp8_per_token"} : f32[T, 32]
      %gu = linear(%r1, @wgu.q) {act_quant="fp8_per_token"} : f32[T, 128]
      %r2 = silu_mul_linear_residual(%gu, @wd.q, %r1) {act_quant="fp8_per_token"} : f32[T, 32]
      %logits = linear(%r2, @emb.q) {act_quant="fp8_per_token"} : f32[T, 40]
      return %logits
    }
""")


def test_quantize_lm_head_quantizes_a_copy_of_a_tied_head_and_the_untied_head_itself():
    ctx = PassContext(quantization=get_method("fp8"), quantize_lm_head=True)
    assert run_pass(quantize, BEFORE, ctx) == EXPECTED_FP8_WITH_HEAD
    assert [r.output for r in ctx.recipes] == ["wqkv.q", "wo.q", "wgu.q", "wd.q", "emb.q"]
    # Untied: the plain head goes.
    after = run_pass(quantize, UNTIED, PassContext(quantization=get_method("mxfp4"), quantize_lm_head=True))
    assert "%lm = rmsnorm_linear(%r2, @ln1, @head.q) {eps=1e-05} : f32[T, 40]" in after
    assert "param @head:" not in after and "param @head.q: u8[40, 16] format=mxfp4(@head.q.scale)" in after


def test_quantize_lm_head_needs_a_method(tmp_path):
    from kiln.compiler.compile import compile_model
    from tests.support.hf_models import make_hf_model

    with pytest.raises(ValueError, match="quantize_lm_head: the lm_head is quantized by the model's quantization "
                                         "method, and none was given; give quantization too \\(fp8, "):
        compile_model(make_hf_model("llama3", tmp_path / "src"), tmp_path / "m.kiln",
                      CompileOptions(dtype="fp32", quantize_lm_head=True))


def test_no_method_leaves_the_graph_and_unknown_ones_list_the_supported():
    assert run_pass(quantize, BEFORE) == BEFORE
    with pytest.raises(ValueError, match="unknown quantization 'int4'; supported: fp8, w8a8_int8, w8a16_int8, mxfp4"):
        CompileOptions(quantization="int4").validate()
