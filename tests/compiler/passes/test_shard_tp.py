"""Before/Expected IR tests of the tensor-parallel sharding pass (a one-layer Qwen2-shaped graph: qkv
bias, GQA, tied embeddings), its recipes for each rank, the KV heads replicated when tp exceeds
them, a row-parallel bias added once, its refusals, and the fusions still fusing the sharded graph."""

import pytest

from kiln.compiler.passes.base import PassContext
from kiln.compiler.passes.shard_tp import shard_tp
from kiln.compiler.pipeline import run_pipeline
from kiln.compiler.recipes import Constant, Shard, Slice, Zeros, for_rank
from kiln.ir import parse_graph, print_graph

from .ir_text import dedent, run_pass


def run(before: str, tp: int, ctx: PassContext | None = None) -> str:
    return run_pass(shard_tp, before, ctx or PassContext(tp=tp))


BEFORE = dedent("""
    graph Qwen2ForCausalLM {
      input %token_ids: i32[T]
      input %positions: i32[T]
      input %slots: i32[T]
      input %q_start: i32[B]
      input %q_len: i32[B]
      input %kv_len: i32[B]
      input %page_table: i32[B, P]
      input %logits_index: i32[N]
      input %k_cache.0: f32[NS, 2, 2]
      input %v_cache.0: f32[NS, 2, 2]
      param @rope.cos_sin: f32[8, 2]
      param @embed_tokens.weight: f32[16, 8]
      param @l0.input_layernorm.weight: f32[8]
      param @l0.self_attn.q_proj.weight: f32[8, 8]
      param @l0.self_attn.q_proj.bias: f32[8]
      param @l0.self_attn.k_proj.weight: f32[4, 8]
      param @l0.self_attn.k_proj.bias: f32[4]
      param @l0.self_attn.v_proj.weight: f32[4, 8]
      param @l0.self_attn.v_proj.bias: f32[4]
      param @l0.self_attn.o_proj.weight: f32[8, 8]
      param @l0.post_attention_layernorm.weight: f32[8]
      param @l0.mlp.gate_proj.weight: f32[12, 8]
      param @l0.mlp.up_proj.weight: f32[12, 8]
      param @l0.mlp.down_proj.weight: f32[8, 12]
      param @norm.weight: f32[8]
      %embed = embedding(%token_ids, @embed_tokens.weight) : f32[T, 8]
      %l0.attn_in = rmsnorm(%embed, @l0.input_layernorm.weight) {eps=1e-06} : f32[T, 8]
      %l0.q = linear(%l0.attn_in, @l0.self_attn.q_proj.weight, @l0.self_attn.q_proj.bias) : f32[T, 8]
      %l0.k = linear(%l0.attn_in, @l0.self_attn.k_proj.weight, @l0.self_attn.k_proj.bias) : f32[T, 4]
      %l0.v = linear(%l0.attn_in, @l0.self_attn.v_proj.weight, @l0.self_attn.v_proj.bias) : f32[T, 4]
      %l0.q_heads = reshape(%l0.q) {shape=["T", 4, 2]} : f32[T, 4, 2]
      %l0.k_heads = reshape(%l0.k) {shape=["T", 2, 2]} : f32[T, 2, 2]
      %l0.v_heads = reshape(%l0.v) {shape=["T", 2, 2]} : f32[T, 2, 2]
      %l0.q_rot = rope(%l0.q_heads, %positions, @rope.cos_sin) : f32[T, 4, 2]
      %l0.k_rot = rope(%l0.k_heads, %positions, @rope.cos_sin) : f32[T, 2, 2]
      %l0.k_cache, %l0.v_cache = kv_store(%k_cache.0, %v_cache.0, %l0.k_rot, %l0.v_heads, %slots) : f32[NS, 2, 2], f32[NS, 2, 2]
      %l0.attn = paged_attention(%l0.q_rot, %l0.k_cache, %l0.v_cache, %q_start, %q_len, %kv_len, %page_table) {page_size=4, scale=0.7071067811865476, sliding_window=0, soft_cap=0.0} : f32[T, 4, 2]
      %l0.attn_flat = reshape(%l0.attn) {shape=["T", 8]} : f32[T, 8]
      %l0.o = linear(%l0.attn_flat, @l0.self_attn.o_proj.weight) : f32[T, 8]
      %l0.resid_attn = add(%embed, %l0.o) : f32[T, 8]
      %l0.mlp_in = rmsnorm(%l0.resid_attn, @l0.post_attention_layernorm.weight) {eps=1e-06} : f32[T, 8]
      %l0.gate = linear(%l0.mlp_in, @l0.mlp.gate_proj.weight) : f32[T, 12]
      %l0.up = linear(%l0.mlp_in, @l0.mlp.up_proj.weight) : f32[T, 12]
      %l0.gate_act = silu(%l0.gate) : f32[T, 12]
      %l0.act = mul(%l0.gate_act, %l0.up) : f32[T, 12]
      %l0.down = linear(%l0.act, @l0.mlp.down_proj.weight) : f32[T, 8]
      %l0.resid_mlp = add(%l0.resid_attn, %l0.down) : f32[T, 8]
      %hidden_states = gather_rows(%l0.resid_mlp, %logits_index) : f32[N, 8]
      %final_norm = rmsnorm(%hidden_states, @norm.weight) {eps=1e-06} : f32[N, 8]
      %lm_logits = linear(%final_norm, @embed_tokens.weight) : f32[N, 16]
      %logits = cast(%lm_logits) {dtype="f32"} : f32[N, 16]
      return %logits
    }
""")

EXPECTED_TP2 = dedent("""
    graph Qwen2ForCausalLM {
      input %token_ids: i32[T]
      input %positions: i32[T]
      input %slots: i32[T]
      input %q_start: i32[B]
      input %q_len: i32[B]
      input %kv_len: i32[B]
      input %page_table: i32[B, P]
      input %logits_index: i32[N]
      input %k_cache.0: f32[NS, 1, 2]
      input %v_cache.0: f32[NS, 1, 2]
      param @rope.cos_sin: f32[8, 2]
      param @l0.input_layernorm.weight: f32[8]
      param @l0.post_attention_layernorm.weight: f32[8]
      param @norm.weight: f32[8]
      param @l0.self_attn.q_proj.weight.shard: f32[4, 8] placement=column(0)
      param @l0.self_attn.q_proj.bias.shard: f32[4] placement=column(0)
      param @l0.self_attn.k_proj.weight.shard: f32[2, 8] placement=column(0)
      param @l0.self_attn.k_proj.bias.shard: f32[2] placement=column(0)
      param @l0.self_attn.v_proj.weight.shard: f32[2, 8] placement=column(0)
      param @l0.self_attn.v_proj.bias.shard: f32[2] placement=column(0)
      param @l0.self_attn.o_proj.weight.shard: f32[8, 4] placement=row(1)
      param @l0.mlp.gate_proj.weight.shard: f32[6, 8] placement=column(0)
      param @l0.mlp.up_proj.weight.shard: f32[6, 8] placement=column(0)
      param @l0.mlp.down_proj.weight.shard: f32[8, 6] placement=row(1)
      param @embed_tokens.weight.shard: f32[8, 8] placement=column(0)
      param @embed_tokens.weight.row_start: i32[1] placement=column(0)
      %embed.part = embedding(%token_ids, @embed_tokens.weight.shard, @embed_tokens.weight.row_start) : f32[T, 8]
      %embed = all_reduce(%embed.part) {world_size=2} : f32[T, 8]
      %l0.attn_in = rmsnorm(%embed, @l0.input_layernorm.weight) {eps=1e-06} : f32[T, 8]
      %l0.q = linear(%l0.attn_in, @l0.self_attn.q_proj.weight.shard, @l0.self_attn.q_proj.bias.shard) : f32[T, 4]
      %l0.k = linear(%l0.attn_in, @l0.self_attn.k_proj.weight.shard, @l0.self_attn.k_proj.bias.shard) : f32[T, 2]
      %l0.v = linear(%l0.attn_in, @l0.self_attn.v_proj.weight.shard, @l0.self_attn.v_proj.bias.shard) : f32[T, 2]
      %l0.q_heads = reshape(%l0.q) {shape=["T", 2, 2]} : f32[T, 2, 2]
      %l0.k_heads = reshape(%l0.k) {shape=["T", 1, 2]} : f32[T, 1, 2]
      %l0.v_heads = reshape(%l0.v) {shape=["T", 1, 2]} : f32[T, 1, 2]
      %l0.q_rot = rope(%l0.q_heads, %positions, @rope.cos_sin) : f32[T, 2, 2]
      %l0.k_rot = rope(%l0.k_heads, %positions, @rope.cos_sin) : f32[T, 1, 2]
      %l0.k_cache, %l0.v_cache = kv_store(%k_cache.0, %v_cache.0, %l0.k_rot, %l0.v_heads, %slots) : f32[NS, 1, 2], f32[NS, 1, 2]
      %l0.attn = paged_attention(%l0.q_rot, %l0.k_cache, %l0.v_cache, %q_start, %q_len, %kv_len, %page_table) {page_size=4, scale=0.7071067811865476, sliding_window=0, soft_cap=0.0} : f32[T, 2, 2]
      %l0.attn_flat = reshape(%l0.attn) {shape=["T", 4]} : f32[T, 4]
      %l0.o.part = linear(%l0.attn_flat, @l0.self_attn.o_proj.weight.shard) : f32[T, 8]
      %l0.o = all_reduce(%l0.o.part) {world_size=2} : f32[T, 8]
      %l0.resid_attn = add(%embed, %l0.o) : f32[T, 8]
      %l0.mlp_in = rmsnorm(%l0.resid_attn, @l0.post_attention_layernorm.weight) {eps=1e-06} : f32[T, 8]
      %l0.gate = linear(%l0.mlp_in, @l0.mlp.gate_proj.weight.shard) : f32[T, 6]
      %l0.up = linear(%l0.mlp_in, @l0.mlp.up_proj.weight.shard) : f32[T, 6]
      %l0.gate_act = silu(%l0.gate) : f32[T, 6]
      %l0.act = mul(%l0.gate_act, %l0.up) : f32[T, 6]
      %l0.down.part = linear(%l0.act, @l0.mlp.down_proj.weight.shard) : f32[T, 8]
      %l0.down = all_reduce(%l0.down.part) {world_size=2} : f32[T, 8]
      %l0.resid_mlp = add(%l0.resid_attn, %l0.down) : f32[T, 8]
      %hidden_states = gather_rows(%l0.resid_mlp, %logits_index) : f32[N, 8]
      %final_norm = rmsnorm(%hidden_states, @norm.weight) {eps=1e-06} : f32[N, 8]
      %lm_logits.part = linear(%final_norm, @embed_tokens.weight.shard) : f32[N, 8]
      %lm_logits = all_gather(%lm_logits.part) {axis=1, world_size=2} : f32[N, 16]
      %logits = cast(%lm_logits) {dtype="f32"} : f32[N, 16]
      return %logits
    }
""")


def test_shard_tp_two_ranks():
    ctx = PassContext(tp=2)
    assert run(BEFORE, 2, ctx) == EXPECTED_TP2
    shards = {r.output: r for r in ctx.recipes if isinstance(r, Shard)}
    assert shards["l0.self_attn.k_proj.weight.shard"] == Shard("l0.self_attn.k_proj.weight.shard",
                                                              "l0.self_attn.k_proj.weight", 0, 2, 2)
    assert shards["l0.mlp.down_proj.weight.shard"].axis == 1  # row-parallel: its input features
    assert Constant("embed_tokens.weight.row_starts", (0, 8)) in ctx.recipes


def test_one_rank_changes_nothing():
    graph = parse_graph(BEFORE)
    ctx = PassContext(tp=1)
    assert shard_tp(graph, ctx) is graph and ctx.recipes == []


def test_kv_heads_are_replicated_when_tp_exceeds_them():
    # 4 q heads and 2 KV heads over 4 ranks: one q head each; ranks 0-1 hold KV head 0, ranks 2-3 KV head 1.
    ctx = PassContext(tp=4)
    text = run(BEFORE, 4, ctx)
    assert "input %k_cache.0: f32[NS, 1, 2]" in text
    assert '%l0.q_heads = reshape(%l0.q) {shape=["T", 1, 2]} : f32[T, 1, 2]' in text
    k_shard = next(r for r in ctx.recipes if r.outputs == ("l0.self_attn.k_proj.weight.shard",))
    assert [r.index for r in (k_shard.for_rank(rank) for rank in range(4))] == [0, 0, 1, 1]
    q_shard = next(r for r in ctx.recipes if r.outputs == ("l0.self_attn.q_proj.weight.shard",))
    assert q_shard.for_rank(3) == Slice("l0.self_attn.q_proj.weight.shard", "l0.self_attn.q_proj.weight", 0, 3, 4)
    assert all(not isinstance(r, Shard) for r in for_rank(ctx.recipes, 2))


@pytest.mark.parametrize("tp, message", [
    (3, r"tp=3 must divide the attention heads \(4 in l0.attn\); possible: 1, 2, 4"),
    (8, r"tp=8 must divide the attention heads"),
])
def test_refuses_what_does_not_split(tp, message):
    with pytest.raises(ValueError, match=message):
        shard_tp(parse_graph(BEFORE), PassContext(tp=tp))


def test_a_row_parallel_bias_is_added_once_by_rank_0():
    with_bias = BEFORE.replace("param @l0.self_attn.o_proj.weight: f32[8, 8]",
                               "param @l0.self_attn.o_proj.weight: f32[8, 8]\n  param @l0.o_bias: f32[8]")
    with_bias = with_bias.replace("linear(%l0.attn_flat, @l0.self_attn.o_proj.weight)",
                                  "linear(%l0.attn_flat, @l0.self_attn.o_proj.weight, @l0.o_bias)")
    ctx = PassContext(tp=2)
    text = run(with_bias, 2, ctx)
    assert "param @l0.o_bias.shard: f32[8] placement=partial" in text
    assert ("%l0.o.part = linear(%l0.attn_flat, @l0.self_attn.o_proj.weight.shard, @l0.o_bias.shard) : f32[T, 8]"
            in text)
    (recipe,) = [r for r in ctx.recipes if r.outputs == ("l0.o_bias.shard",)]
    assert recipe.for_rank(0) == Slice("l0.o_bias.shard", "l0.o_bias", 0, 0, 1)
    assert recipe.for_rank(1) == Zeros("l0.o_bias.shard", "l0.o_bias")


def test_the_fusions_fuse_the_sharded_graph():
    graph, _ = run_pipeline(parse_graph(BEFORE), PassContext(tp=2, symbol_bounds={"T": 8, "B": 2, "N": 2, "P": 2}))
    text = print_graph(graph)
    assert "param @l0.self_attn.q_k_v_proj.weight.shard: f32[8, 8] placement=column(0)" in text
    assert "param @l0.mlp.gate_up_proj.weight.shard: f32[12, 8] placement=column(0)" in text
    ops = [node.op for node in graph.nodes]
    assert ops.count("all_reduce") == 3 and ops.count("all_gather") == 1
    assert {"rmsnorm_linear", "silu_mul", "rope_kv_attention"} <= set(ops)
    # A residual add never joins a row-parallel GEMM: its sum is complete only after the all_reduce.
    assert "linear_residual" not in ops and "silu_mul_linear_residual" not in ops


def test_refuses_a_vocabulary_that_does_not_split():
    odd_vocab = BEFORE.replace("f32[16, 8]", "f32[15, 8]").replace("f32[N, 16]", "f32[N, 15]")
    with pytest.raises(ValueError, match=r"tp=2 must divide the vocabulary \(15 rows of the embedding"):
        shard_tp(parse_graph(odd_vocab), PassContext(tp=2))
