"""Before/Expected IR tests of fuse_linear_residual, fuse_silu_mul_linear and fuse_norm_linear (GEMMs
absorbing the norm or gated activation before them and the residual add after them)."""

from kiln.compiler.passes.fuse_linear_residual import fuse_linear_residual
from kiln.compiler.passes.fuse_norm_linear import fuse_norm_linear
from kiln.compiler.passes.fuse_silu_mul_linear import fuse_silu_mul_linear

from .ir_text import dedent, run_pass

LAYER_BEFORE = dedent("""
    graph g {
      input %h: f32[T, 8]
      param @ln1: f32[8]
      param @wqkv: f32[16, 8]
      param @wo: f32[8, 16]
      param @ln2: f32[8]
      param @wgu: f32[12, 8]
      param @wd: f32[8, 6]
      %n1 = rmsnorm(%h, @ln1) {eps=1e-05} : f32[T, 8]
      %qkv = linear(%n1, @wqkv) : f32[T, 16]
      %o = linear(%qkv, @wo) : f32[T, 8]
      %r1 = add(%h, %o) : f32[T, 8]
      %n2 = rmsnorm(%r1, @ln2) {eps=1e-05} : f32[T, 8]
      %gu = linear(%n2, @wgu) : f32[T, 12]
      %g, %u = split(%gu) {sizes=[6, 6]} : f32[T, 6], f32[T, 6]
      %m = silu_mul(%g, %u) : f32[T, 6]
      %d = linear(%m, @wd) : f32[T, 8]
      %r2 = add(%d, %r1) : f32[T, 8]
      return %r2
    }
""")

AFTER_RESIDUAL = dedent("""
    graph g {
      input %h: f32[T, 8]
      param @ln1: f32[8]
      param @wqkv: f32[16, 8]
      param @wo: f32[8, 16]
      param @ln2: f32[8]
      param @wgu: f32[12, 8]
      param @wd: f32[8, 6]
      %n1 = rmsnorm(%h, @ln1) {eps=1e-05} : f32[T, 8]
      %qkv = linear(%n1, @wqkv) : f32[T, 16]
      %r1 = linear_residual(%qkv, @wo, %h) : f32[T, 8]
      %n2 = rmsnorm(%r1, @ln2) {eps=1e-05} : f32[T, 8]
      %gu = linear(%n2, @wgu) : f32[T, 12]
      %g, %u = split(%gu) {sizes=[6, 6]} : f32[T, 6], f32[T, 6]
      %m = silu_mul(%g, %u) : f32[T, 6]
      %r2 = linear_residual(%m, @wd, %r1) : f32[T, 8]
      return %r2
    }
""")


def test_fuse_linear_residual_takes_the_gemm_side_of_either_operand():
    assert run_pass(fuse_linear_residual, LAYER_BEFORE) == AFTER_RESIDUAL


def test_fuse_linear_residual_keeps_gemm_outputs_read_elsewhere_and_biased_gemms():
    read_twice = LAYER_BEFORE.replace("return %r2", "return %r2, %d")
    assert "linear_residual(%m" not in run_pass(fuse_linear_residual, read_twice)
    biased = LAYER_BEFORE.replace("param @wd: f32[8, 6]", "param @wd: f32[8, 6]\n  param @bd: f32[8]") \
        .replace("linear(%m, @wd)", "linear(%m, @wd, @bd)")
    assert "linear_residual(%m" not in run_pass(fuse_linear_residual, biased)


MOE_BEFORE = dedent("""
    graph g {
      input %h: f32[T, 8]
      param @ln: f32[8]
      param @router: f32[4, 8]
      param @gu: f32[4, 12, 8]
      param @d: f32[4, 8, 6]
      %n = rmsnorm(%h, @ln) {eps=1e-05} : f32[T, 8]
      %logits = linear(%n, @router) : f32[T, 4]
      %w, %ids = router_topk(%logits) {renormalize=true, scoring="softmax", top_k=2} : f32[T, 2], i32[T, 2]
      %e = moe(%n, %w, %ids, @gu, @d) {expert_offset=0} : f32[T, 8]
      %r = add(%h, %e) : f32[T, 8]
      return %r
    }
""")


def test_fuse_linear_residual_folds_the_add_after_the_experts():
    assert run_pass(fuse_linear_residual, MOE_BEFORE) == dedent("""
        graph g {
          input %h: f32[T, 8]
          param @ln: f32[8]
          param @router: f32[4, 8]
          param @gu: f32[4, 12, 8]
          param @d: f32[4, 8, 6]
          %n = rmsnorm(%h, @ln) {eps=1e-05} : f32[T, 8]
          %logits = linear(%n, @router) : f32[T, 4]
          %w, %ids = router_topk(%logits) {renormalize=true, scoring="softmax", top_k=2} : f32[T, 2], i32[T, 2]
          %r = moe_residual(%n, %w, %ids, @gu, @d, %h) {expert_offset=0} : f32[T, 8]
          return %r
        }
    """)
    # Either operand; but not a rank's experts (expert_start: the add follows their all_reduce).
    assert "moe_residual(" in run_pass(fuse_linear_residual, MOE_BEFORE.replace("add(%h, %e)", "add(%e, %h)"))
    ranked = MOE_BEFORE.replace("param @d: f32[4, 8, 6]", "param @d: f32[4, 8, 6]\n  param @start: i32[1]") \
        .replace("@gu, @d)", "@gu, @d, @start)")
    assert run_pass(fuse_linear_residual, ranked) == ranked

AFTER_SILU_MUL = dedent("""
    graph g {
      input %h: f32[T, 8]
      param @ln1: f32[8]
      param @wqkv: f32[16, 8]
      param @wo: f32[8, 16]
      param @ln2: f32[8]
      param @wgu: f32[12, 8]
      param @wd: f32[8, 6]
      %n1 = rmsnorm(%h, @ln1) {eps=1e-05} : f32[T, 8]
      %qkv = linear(%n1, @wqkv) : f32[T, 16]
      %r1 = linear_residual(%qkv, @wo, %h) : f32[T, 8]
      %n2 = rmsnorm(%r1, @ln2) {eps=1e-05} : f32[T, 8]
      %gu = linear(%n2, @wgu) : f32[T, 12]
      %r2 = silu_mul_linear_residual(%gu, @wd, %r1) : f32[T, 8]
      return %r2
    }
""")


def test_fuse_silu_mul_linear_folds_split_and_activation_into_the_down_gemm():
    assert run_pass(fuse_silu_mul_linear, AFTER_RESIDUAL) == AFTER_SILU_MUL


def test_fuse_silu_mul_linear_keeps_halves_or_activations_read_elsewhere():
    for value in ("%g", "%u", "%m"):
        read_elsewhere = AFTER_RESIDUAL.replace("return %r2", f"return %r2, {value}")
        assert run_pass(fuse_silu_mul_linear, read_elsewhere) == read_elsewhere
    # Only the residual GEMM takes it (a down projection without the add keeps its silu_mul).
    no_residual = LAYER_BEFORE.replace("%r2 = add(%d, %r1) : f32[T, 8]\n  ", "").replace("return %r2", "return %d")
    assert run_pass(fuse_silu_mul_linear, no_residual) == no_residual


def test_fuse_norm_linear_after_residuals_and_activation():
    assert run_pass(fuse_norm_linear, AFTER_SILU_MUL) == dedent("""
        graph g {
          input %h: f32[T, 8]
          param @ln1: f32[8]
          param @wqkv: f32[16, 8]
          param @wo: f32[8, 16]
          param @ln2: f32[8]
          param @wgu: f32[12, 8]
          param @wd: f32[8, 6]
          %qkv = rmsnorm_linear(%h, @ln1, @wqkv) {eps=1e-05} : f32[T, 16]
          %r1 = linear_residual(%qkv, @wo, %h) : f32[T, 8]
          %gu = rmsnorm_linear(%r1, @ln2, @wgu) {eps=1e-05} : f32[T, 12]
          %r2 = silu_mul_linear_residual(%gu, @wd, %r1) : f32[T, 8]
          return %r2
        }
    """)


def test_fuse_norm_linear_keeps_norms_with_several_readers_or_non_gemm_readers():
    shared = AFTER_RESIDUAL.replace("return %r2", "return %r2, %n1")
    assert "%n1 = rmsnorm(%h, @ln1)" in run_pass(fuse_norm_linear, shared)
    not_gemm_input = AFTER_RESIDUAL.replace("%qkv = linear(%n1, @wqkv) : f32[T, 16]",
                                            "%qkv = linear(%h, @wqkv) : f32[T, 16]\n  %z = add(%n1, %h) : f32[T, 8]") \
        .replace("return %r2", "return %r2, %z")
    assert "%n1 = rmsnorm(%h, @ln1)" in run_pass(fuse_norm_linear, not_gemm_input)


def test_fuse_norm_linear_keeps_a_bias():
    biased = AFTER_RESIDUAL.replace("param @wqkv: f32[16, 8]", "param @wqkv: f32[16, 8]\n  param @bqkv: f32[16]") \
        .replace("linear(%n1, @wqkv)", "linear(%n1, @wqkv, @bqkv)")
    assert "%qkv = rmsnorm_linear(%h, @ln1, @wqkv, @bqkv) {eps=1e-05} : f32[T, 16]" in run_pass(fuse_norm_linear, biased)
