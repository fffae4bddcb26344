"""Before/Expected IR tests of the pipeline split (a two-layer Llama-shaped graph): each stage keeps its
layer, its KV caches and the weights it reads (the tied embedding in both), the first stage sends the
residual stream on and the last receives it and returns the logits (which the runtime sends to stage 0); with tensor parallelism
the stage's collectives run in the ``tp`` group; the refusals; and the whole pipeline compiling a stage."""

import pytest

from kiln.compiler.passes.base import PassContext
from kiln.compiler.passes.shard_tp import shard_tp
from kiln.compiler.passes.split_pipeline import split_pipeline, stage_layers
from kiln.compiler.pipeline import run_pipeline
from kiln.ir import parse_graph, print_graph

from .ir_text import dedent, run_pass


def run(before: str, pp: int, stage: int) -> str:
    return run_pass(split_pipeline, before, PassContext(pp=pp, stage=stage))


BEFORE = dedent("""
    graph LlamaForCausalLM {
      input %token_ids: i32[T]
      input %positions: i32[T]
      input %slots: i32[T]
      input %q_start: i32[B]
      input %q_len: i32[B]
      input %kv_len: i32[B]
      input %page_table: i32[B, P]
      input %logits_index: i32[N]
      input %k_cache.0: f32[NS, 1, 4]
      input %v_cache.0: f32[NS, 1, 4]
      input %k_cache.1: f32[NS, 1, 4]
      input %v_cache.1: f32[NS, 1, 4]
      param @embed_tokens.weight: f32[16, 8]
      param @l0.norm.weight: f32[8]
      param @l0.q_proj.weight: f32[8, 8]
      param @l0.k_proj.weight: f32[4, 8]
      param @l0.v_proj.weight: f32[4, 8]
      param @l0.o_proj.weight: f32[8, 8]
      param @l1.norm.weight: f32[8]
      param @l1.q_proj.weight: f32[8, 8]
      param @l1.k_proj.weight: f32[4, 8]
      param @l1.v_proj.weight: f32[4, 8]
      param @l1.o_proj.weight: f32[8, 8]
      param @norm.weight: f32[8]
      %embed = embedding(%token_ids, @embed_tokens.weight) : f32[T, 8]
      %l0.attn_in = rmsnorm(%embed, @l0.norm.weight) {eps=1e-06} : f32[T, 8]
      %l0.q = linear(%l0.attn_in, @l0.q_proj.weight) : f32[T, 8]
      %l0.k = linear(%l0.attn_in, @l0.k_proj.weight) : f32[T, 4]
      %l0.v = linear(%l0.attn_in, @l0.v_proj.weight) : f32[T, 4]
      %l0.q_heads = reshape(%l0.q) {shape=["T", 2, 4]} : f32[T, 2, 4]
      %l0.k_heads = reshape(%l0.k) {shape=["T", 1, 4]} : f32[T, 1, 4]
      %l0.v_heads = reshape(%l0.v) {shape=["T", 1, 4]} : f32[T, 1, 4]
      %l0.k_cache, %l0.v_cache = kv_store(%k_cache.0, %v_cache.0, %l0.k_heads, %l0.v_heads, %slots) : f32[NS, 1, 4], f32[NS, 1, 4]
      %l0.attn = paged_attention(%l0.q_heads, %l0.k_cache, %l0.v_cache, %q_start, %q_len, %kv_len, %page_table) {page_size=4, scale=0.5, sliding_window=0, soft_cap=0.0} : f32[T, 2, 4]
      %l0.attn_flat = reshape(%l0.attn) {shape=["T", 8]} : f32[T, 8]
      %l0.o = linear(%l0.attn_flat, @l0.o_proj.weight) : f32[T, 8]
      %l0.resid = add(%embed, %l0.o) : f32[T, 8]
      %l1.attn_in = rmsnorm(%l0.resid, @l1.norm.weight) {eps=1e-06} : f32[T, 8]
      %l1.q = linear(%l1.attn_in, @l1.q_proj.weight) : f32[T, 8]
      %l1.k = linear(%l1.attn_in, @l1.k_proj.weight) : f32[T, 4]
      %l1.v = linear(%l1.attn_in, @l1.v_proj.weight) : f32[T, 4]
      %l1.q_heads = reshape(%l1.q) {shape=["T", 2, 4]} : f32[T, 2, 4]
      %l1.k_heads = reshape(%l1.k) {shape=["T", 1, 4]} : f32[T, 1, 4]
      %l1.v_heads = reshape(%l1.v) {shape=["T", 1, 4]} : f32[T, 1, 4]
      %l1.k_cache, %l1.v_cache = kv_store(%k_cache.1, %v_cache.1, %l1.k_heads, %l1.v_heads, %slots) : f32[NS, 1, 4], f32[NS, 1, 4]
      %l1.attn = paged_attention(%l1.q_heads, %l1.k_cache, %l1.v_cache, %q_start, %q_len, %kv_len, %page_table) {page_size=4, scale=0.5, sliding_window=0, soft_cap=0.0} : f32[T, 2, 4]
      %l1.attn_flat = reshape(%l1.attn) {shape=["T", 8]} : f32[T, 8]
      %l1.o = linear(%l1.attn_flat, @l1.o_proj.weight) : f32[T, 8]
      %l1.resid = add(%l0.resid, %l1.o) : f32[T, 8]
      %hidden_states = gather_rows(%l1.resid, %logits_index) : f32[N, 8]
      %final_norm = rmsnorm(%hidden_states, @norm.weight) {eps=1e-06} : f32[N, 8]
      %lm_logits = linear(%final_norm, @embed_tokens.weight) : f32[N, 16]
      %logits = cast(%lm_logits) {dtype="f32"} : f32[N, 16]
      return %logits
    }
""")

EXPECTED_STAGE0 = dedent("""
    graph LlamaForCausalLM {
      input %token_ids: i32[T]
      input %positions: i32[T]
      input %slots: i32[T]
      input %q_start: i32[B]
      input %q_len: i32[B]
      input %kv_len: i32[B]
      input %page_table: i32[B, P]
      input %logits_index: i32[N]
      input %k_cache.0: f32[NS, 1, 4]
      input %v_cache.0: f32[NS, 1, 4]
      param @embed_tokens.weight: f32[16, 8]
      param @l0.norm.weight: f32[8]
      param @l0.q_proj.weight: f32[8, 8]
      param @l0.k_proj.weight: f32[4, 8]
      param @l0.v_proj.weight: f32[4, 8]
      param @l0.o_proj.weight: f32[8, 8]
      %embed = embedding(%token_ids, @embed_tokens.weight) : f32[T, 8]
      %l0.attn_in = rmsnorm(%embed, @l0.norm.weight) {eps=1e-06} : f32[T, 8]
      %l0.q = linear(%l0.attn_in, @l0.q_proj.weight) : f32[T, 8]
      %l0.k = linear(%l0.attn_in, @l0.k_proj.weight) : f32[T, 4]
      %l0.v = linear(%l0.attn_in, @l0.v_proj.weight) : f32[T, 4]
      %l0.q_heads = reshape(%l0.q) {shape=["T", 2, 4]} : f32[T, 2, 4]
      %l0.k_heads = reshape(%l0.k) {shape=["T", 1, 4]} : f32[T, 1, 4]
      %l0.v_heads = reshape(%l0.v) {shape=["T", 1, 4]} : f32[T, 1, 4]
      %l0.k_cache, %l0.v_cache = kv_store(%k_cache.0, %v_cache.0, %l0.k_heads, %l0.v_heads, %slots) : f32[NS, 1, 4], f32[NS, 1, 4]
      %l0.attn = paged_attention(%l0.q_heads, %l0.k_cache, %l0.v_cache, %q_start, %q_len, %kv_len, %page_table) {page_size=4, scale=0.5, sliding_window=0, soft_cap=0.0} : f32[T, 2, 4]
      %l0.attn_flat = reshape(%l0.attn) {shape=["T", 8]} : f32[T, 8]
      %l0.o = linear(%l0.attn_flat, @l0.o_proj.weight) : f32[T, 8]
      %l0.resid = add(%embed, %l0.o) : f32[T, 8]
      %l0.resid.sent = send(%l0.resid) {group="pp", peer=1} : f32[T, 8]
      return %l0.resid.sent
    }
""")

EXPECTED_STAGE1 = dedent("""
    graph LlamaForCausalLM {
      input %token_ids: i32[T]
      input %positions: i32[T]
      input %slots: i32[T]
      input %q_start: i32[B]
      input %q_len: i32[B]
      input %kv_len: i32[B]
      input %page_table: i32[B, P]
      input %logits_index: i32[N]
      input %k_cache.1: f32[NS, 1, 4]
      input %v_cache.1: f32[NS, 1, 4]
      param @embed_tokens.weight: f32[16, 8]
      param @l1.norm.weight: f32[8]
      param @l1.q_proj.weight: f32[8, 8]
      param @l1.k_proj.weight: f32[4, 8]
      param @l1.v_proj.weight: f32[4, 8]
      param @l1.o_proj.weight: f32[8, 8]
      param @norm.weight: f32[8]
      %l0.resid = recv() {dtype="f32", group="pp", peer=0, shape=["T", 8]} : f32[T, 8]
      %l1.attn_in = rmsnorm(%l0.resid, @l1.norm.weight) {eps=1e-06} : f32[T, 8]
      %l1.q = linear(%l1.attn_in, @l1.q_proj.weight) : f32[T, 8]
      %l1.k = linear(%l1.attn_in, @l1.k_proj.weight) : f32[T, 4]
      %l1.v = linear(%l1.attn_in, @l1.v_proj.weight) : f32[T, 4]
      %l1.q_heads = reshape(%l1.q) {shape=["T", 2, 4]} : f32[T, 2, 4]
      %l1.k_heads = reshape(%l1.k) {shape=["T", 1, 4]} : f32[T, 1, 4]
      %l1.v_heads = reshape(%l1.v) {shape=["T", 1, 4]} : f32[T, 1, 4]
      %l1.k_cache, %l1.v_cache = kv_store(%k_cache.1, %v_cache.1, %l1.k_heads, %l1.v_heads, %slots) : f32[NS, 1, 4], f32[NS, 1, 4]
      %l1.attn = paged_attention(%l1.q_heads, %l1.k_cache, %l1.v_cache, %q_start, %q_len, %kv_len, %page_table) {page_size=4, scale=0.5, sliding_window=0, soft_cap=0.0} : f32[T, 2, 4]
      %l1.attn_flat = reshape(%l1.attn) {shape=["T", 8]} : f32[T, 8]
      %l1.o = linear(%l1.attn_flat, @l1.o_proj.weight) : f32[T, 8]
      %l1.resid = add(%l0.resid, %l1.o) : f32[T, 8]
      %hidden_states = gather_rows(%l1.resid, %logits_index) : f32[N, 8]
      %final_norm = rmsnorm(%hidden_states, @norm.weight) {eps=1e-06} : f32[N, 8]
      %lm_logits = linear(%final_norm, @embed_tokens.weight) : f32[N, 16]
      %logits = cast(%lm_logits) {dtype="f32"} : f32[N, 16]
      return %logits
    }
""")


def test_the_first_stage_sends_the_residual_stream_on():
    assert run(BEFORE, 2, 0) == EXPECTED_STAGE0


def test_the_last_stage_receives_it_and_returns_the_logits():
    assert run(BEFORE, 2, 1) == EXPECTED_STAGE1


def test_one_stage_changes_nothing():
    assert run(BEFORE, 1, 0) == BEFORE


def test_with_tensor_parallelism_the_stage_collectives_run_in_the_tp_group():
    graph = shard_tp(parse_graph(BEFORE), PassContext(tp=2))
    after = print_graph(split_pipeline(graph, PassContext(tp=2, pp=2, stage=1)))
    assert '%l1.o = all_reduce(%l1.o.part) {group="tp", world_size=2} : f32[T, 8]' in after
    assert '%lm_logits = all_gather(%lm_logits.part) {axis=1, group="tp", world_size=2} : f32[N, 16]' in after
    assert "param @embed_tokens.weight.shard: f32[8, 8] placement=column(0)" in after


def test_layers_split_evenly_the_first_stages_one_more():
    assert [stage_layers(30, 4, s) for s in range(4)] == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]


def test_more_stages_than_layers_are_refused():
    with pytest.raises(ValueError, match="pp=3: the model has 2 decoder layers.*at most 2"):
        split_pipeline(parse_graph(BEFORE), PassContext(pp=3, stage=0))


def test_the_fusions_and_planning_run_on_a_stage():
    graph, log = run_pipeline(parse_graph(BEFORE), PassContext(pp=2, stage=1, symbol_bounds=dict(T=8, B=2, N=2, P=4)))
    assert graph.nodes[0].op == "recv" and graph.outputs == ("logits",)
    assert "split_pipeline" in [entry["pass"] for entry in log]
