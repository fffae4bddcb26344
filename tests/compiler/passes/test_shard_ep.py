"""Before/Expected IR tests of the expert-parallel pass (one sparse layer: router, top-2 of 4
experts), its recipes for each rank, its refusals, and the whole pipeline over a real MoE model's
graph at ep=2 alone and inside tp=2 (Qwen2-MoE: a dense layer, a shared expert), and ep=2 inside
tp=4, where each expert's width is split too."""

import pytest
import torch

from kiln.compiler.passes.base import PassContext
from kiln.compiler.passes.shard_ep import shard_ep
from kiln.compiler.pipeline import run_pipeline
from kiln.compiler.recipes import Constant, Slice, apply_recipes, for_rank
from kiln.ir import parse_graph, print_graph
from kiln.models import BuildOptions, family_for
from kiln.tensors import parse_float_dtype
from tests.models.test_moe import hf_config

from .ir_text import dedent, run_pass


def run(before: str, ctx: PassContext) -> str:
    return run_pass(shard_ep, before, ctx)


BEFORE = dedent("""
    graph Qwen3MoeForCausalLM {
      input %x: f32[T, 8]
      param @l0.mlp.gate.weight: f32[4, 8]
      param @l0.mlp.experts.gate_up_proj: f32[4, 12, 8]
      param @l0.mlp.experts.down_proj: f32[4, 8, 6]
      %l0.router = linear(%x, @l0.mlp.gate.weight) : f32[T, 4]
      %l0.route_w, %l0.route_ids = router_topk(%l0.router) {renormalize=true, scoring="softmax", top_k=2} : f32[T, 2], i32[T, 2]
      %l0.experts = moe(%x, %l0.route_w, %l0.route_ids, @l0.mlp.experts.gate_up_proj, @l0.mlp.experts.down_proj) {expert_offset=0} : f32[T, 8]
      return %l0.experts
    }
""")

EXPECTED_EP2 = dedent("""
    graph Qwen3MoeForCausalLM {
      input %x: f32[T, 8]
      param @l0.mlp.gate.weight: f32[4, 8]
      param @l0.mlp.experts.gate_up_proj.shard: f32[2, 12, 8] placement=expert(0)
      param @l0.mlp.experts.down_proj.shard: f32[2, 8, 6] placement=expert(0)
      param @l0.mlp.experts.gate_up_proj.expert_start: i32[1] placement=expert(0)
      %l0.router = linear(%x, @l0.mlp.gate.weight) : f32[T, 4]
      %l0.route_w, %l0.route_ids = router_topk(%l0.router) {renormalize=true, scoring="softmax", top_k=2} : f32[T, 2], i32[T, 2]
      %l0.experts.part = moe(%x, %l0.route_w, %l0.route_ids, @l0.mlp.experts.gate_up_proj.shard, @l0.mlp.experts.down_proj.shard, @l0.mlp.experts.gate_up_proj.expert_start) {expert_offset=0} : f32[T, 8]
      %l0.experts = all_reduce(%l0.experts.part) {world_size=2} : f32[T, 8]
      return %l0.experts
    }
""")


def test_shard_ep_two_ranks():
    ctx = PassContext(ep=2)
    assert run(BEFORE, ctx) == EXPECTED_EP2
    assert Constant("l0.mlp.experts.gate_up_proj.expert_starts", (0, 2)) in ctx.recipes
    rank1 = {r.output: r for r in for_rank(ctx.recipes, 1) if isinstance(r, Slice)}
    assert rank1["l0.mlp.experts.down_proj.shard"] == Slice("l0.mlp.experts.down_proj.shard",
                                                            "l0.mlp.experts.down_proj", 0, 1, 2)
    assert rank1["l0.mlp.experts.gate_up_proj.expert_start"].index == 1  # rank 1 starts at expert 2


def test_four_expert_ranks_hold_one_expert_each():
    ctx = PassContext(ep=4)
    text = run(BEFORE, ctx)
    assert "param @l0.mlp.experts.gate_up_proj.shard: f32[1, 12, 8] placement=expert(0)" in text
    assert "{world_size=4}" in text
    assert Constant("l0.mlp.experts.gate_up_proj.expert_starts", (0, 1, 2, 3)) in ctx.recipes


def test_one_rank_changes_nothing():
    graph = parse_graph(BEFORE)
    ctx = PassContext(ep=1)
    assert shard_ep(graph, ctx) is graph and ctx.recipes == []


def test_ep_inside_a_larger_tp_splits_each_experts_width_too():
    """tp=4 ep=2: rank r holds experts 2*(r // 2) .. +1, and of them intermediate part r % 2 (gate
    rows and up rows alike, down columns); every rank's output is a part of the sum."""
    ctx = PassContext(ep=2, tp=4)
    text = run(BEFORE, ctx)
    assert "param @l0.mlp.experts.gate_up_proj.shard: f32[2, 6, 8] placement=expert(0)" in text
    assert "param @l0.mlp.experts.down_proj.shard: f32[2, 8, 3] placement=expert(0)" in text
    assert "%l0.experts = all_reduce(%l0.experts.part) {world_size=4} : f32[T, 8]" in text
    gate_up = torch.randn(4, 12, 8)
    down = torch.randn(4, 8, 6)
    sources = {"l0.mlp.experts.gate_up_proj": gate_up, "l0.mlp.experts.down_proj": down}
    for rank in range(4):
        group, part = rank // 2, rank % 2
        made = dict(apply_recipes(for_rank(ctx.recipes, rank), ["l0.mlp.experts.gate_up_proj.shard",
                                                                 "l0.mlp.experts.down_proj.shard",
                                                                 "l0.mlp.experts.gate_up_proj.expert_start"],
                                  sources.__getitem__))
        experts = slice(2 * group, 2 * group + 2)
        rows = [*range(3 * part, 3 * part + 3), *range(6 + 3 * part, 6 + 3 * part + 3)]  # gate part, up part
        assert torch.equal(made["l0.mlp.experts.gate_up_proj.shard"], gate_up[experts][:, rows])
        assert torch.equal(made["l0.mlp.experts.down_proj.shard"], down[experts][:, :, 3 * part:3 * part + 3])
        assert made["l0.mlp.experts.gate_up_proj.expert_start"].tolist() == [2 * group]


@pytest.mark.parametrize("ep, tp, message", [
    (3, 1, r"ep=3 must divide the experts \(4 in l0.experts\); possible ep: 1, 2, 4"),
    (4, 2, r"ep=4 with tp=2 is not supported: .*tp=1 \(attention replicated\) or ep dividing tp"),
    (2, 8, r"tp=8 / ep=2 = 4 must divide the experts' intermediate size \(6 in l0.experts\)"),
])
def test_refuses_what_does_not_split(ep, tp, message):
    with pytest.raises(ValueError, match=message):
        shard_ep(parse_graph(BEFORE), PassContext(ep=ep, tp=tp))


def test_refuses_a_model_without_experts():
    dense = parse_graph(dedent("""
        graph LlamaForCausalLM {
          input %x: f32[T, 8]
          param @w: f32[8, 8]
          %y = linear(%x, @w) : f32[T, 8]
          return %y
        }
    """))
    with pytest.raises(ValueError, match="ep=2: LlamaForCausalLM has no routed experts"):
        shard_ep(dense, PassContext(ep=2))


def _qwen2_moe_graph():
    config = hf_config("qwen2_moe")
    return family_for(config).build(config, BuildOptions(parse_float_dtype("fp32"), 4, 64)).graph


@pytest.mark.parametrize("tp", [1, 2])
def test_the_pipeline_shards_a_real_moe_model(tp):
    """Qwen2-MoE (layer 0 dense, layer 1 sparse with a shared expert) through every pass at ep=2: the
    experts split, one all_reduce for them; with tp=2 attention, the dense MLP and the shared expert
    are tensor-parallel over the same two ranks, each with its own all_reduce."""
    bounds = {"T": 8, "B": 2, "N": 2, "P": 16}
    graph, log = run_pipeline(_qwen2_moe_graph(), PassContext(tp=tp, ep=2, symbol_bounds=bounds))
    text = print_graph(graph)
    assert "param @model.layers.1.mlp.experts.gate_up_proj.shard: f32[4, 96, 64] placement=expert(0)" in text
    assert [entry["pass"] for entry in log][:7] == ["verify", "expose_hidden_states", "tree_attention", "shard_tp",
                                                   "split_pipeline", "place_experts", "shard_ep"]
    reduces = [node for node in graph.nodes if node.op == "all_reduce"]
    assert all(node.attrs["world_size"] == 2 for node in reduces)
    # ep alone: only the experts' sum; inside tp=2 also the embedding, 2 attention o's, the dense
    # MLP's down and the shared expert's down.
    assert len(reduces) == (1 if tp == 1 else 6)
    assert ("param @model.layers.1.self_attn.o_proj.weight.shard" in text) == (tp == 2)
