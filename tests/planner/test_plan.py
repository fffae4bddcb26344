"""The planner on known shapes: what it chooses, the numbers behind it, and the reasons it prints.

The byte counts are exact arithmetic on the published shapes (Llama-3-8B has 8,030,261,248
parameters, Llama-3-70B 70,553,706,496), so they are compared exactly.
"""

from __future__ import annotations

import pytest

from kiln.planner import ModelShape, PlanError, PlanRequest, make_plan
from kiln.planner.memory import Layout, WeightStorage, stages
from tests.planner.configs import LLAMA3_8B, LLAMA3_70B, LLAMA31_405B, MIXTRAL_8X7B, ODD_HEADS_70B, llama


def test_parameter_counts_match_the_published_models():
    assert ModelShape.from_hf(LLAMA3_8B).parameter_count() == 8_030_261_248
    assert ModelShape.from_hf(LLAMA3_70B).parameter_count() == 70_553_706_496


def test_llama3_8b_fits_one_gpu_at_tp1():
    plan = make_plan(ModelShape.from_hf(LLAMA3_8B), PlanRequest(gpus=1))
    assert (plan.tp, plan.pp, plan.ep, plan.dp) == (1, 1, 1, 1)
    assert plan.weight_bytes_per_rank == 8_030_261_248 * 2
    assert plan.kv_bytes_per_token_per_rank == 32 * 2 * 8 * 128 * 2
    assert plan.allreduce_bytes_per_step == 0 and plan.allreduce_s == 0
    # 68 GB usable (85% of 80 GB) less the weights, in whole tokens.
    assert plan.kv_tokens == int((80e9 * 0.85 - plan.weight_bytes_per_rank) // plan.kv_bytes_per_token_per_rank)
    print(plan.chosen_because)


def test_llama3_70b_bf16_on_eight_h100s_takes_tp4_and_two_replicas():
    plan = make_plan(ModelShape.from_hf(LLAMA3_70B), PlanRequest(gpus=8))
    print("\n".join([plan.chosen_because, *plan.rejected, *plan.notes]))
    # The rule: the smallest tp that fits. tp=2 needs 70.6 GB a rank of the 68 GB usable.
    assert (plan.tp, plan.pp, plan.dp) == (4, 1, 2)
    assert "tp=1 pp=1: weights 141.1 GB a rank exceed the 68.0 GB usable" in plan.rejected
    assert "tp=2 pp=1: weights 70.6 GB a rank exceed the 68.0 GB usable" in plan.rejected
    assert "tp=3/5/6/7: the 64 attention heads do not divide by it" in plan.rejected
    assert plan.kv_heads_per_rank == 2 and plan.kv_bytes_per_token_per_rank == 80 * 2 * 2 * 128 * 2
    assert plan.allreduce_bytes_per_step == 2 * 80 * 8192 * 1 * 2
    assert plan.requested_kv_tokens == 8192 <= plan.kv_tokens
    # Weights + KV read once a step at 90% of 3.35 TB/s, plus the all-reduces.
    assert plan.decode_step_s == pytest.approx(plan.decode_bytes_per_step / (3.35e12 * 0.9) + plan.allreduce_s)


def test_more_kv_moves_to_a_larger_tp():
    shape = ModelShape.from_hf(LLAMA3_70B)
    plan = make_plan(shape, PlanRequest(gpus=8, quantization="fp8", concurrency=64))
    assert plan.tp == 4
    assert any(r.startswith("tp=2 pp=1: weights 36.3 GB a rank leave room for") for r in plan.rejected)


def test_405b_on_two_gpus_cannot_fit_and_says_why():
    with pytest.raises(PlanError) as caught:
        make_plan(ModelShape.from_hf(LLAMA31_405B), PlanRequest(gpus=2))
    print(caught.value)
    assert "need at least 12 GPUs" in caught.value.summary
    assert caught.value.reasons == ["tp=1 pp=1: weights 811.7 GB a rank exceed the 68.0 GB usable",
                                    "tp=2 pp=1: weights 405.9 GB a rank exceed the 68.0 GB usable",
                                    "tp=1 pp=2: weights 405.9 GB a rank exceed the 68.0 GB usable"]


def test_405b_on_two_nodes_keeps_tp_within_a_node_and_adds_pipeline_stages():
    plan = make_plan(ModelShape.from_hf(LLAMA31_405B), PlanRequest(gpus=16))
    assert (plan.tp, plan.pp) == (8, 2)
    assert "tp>8: would span nodes (8 GPUs a node); pp crosses nodes" in plan.rejected


def test_heads_that_do_not_divide_are_a_reason():
    with pytest.raises(PlanError) as caught:
        make_plan(ModelShape.from_hf(ODD_HEADS_70B), PlanRequest(gpus=2))
    print(caught.value)
    assert caught.value.reasons[0] == "tp=2: the 63 attention heads do not divide by it"


def test_heads_that_do_not_divide_fall_back_to_pipeline_stages():
    # SmolLM2-135M's shape (9 heads, 3 KV heads) on two GPUs too small for it.
    shape = ModelShape.from_hf(llama(576, 30, 9, 3, 1536, vocab=49152, tie_word_embeddings=True))
    plan = make_plan(shape, PlanRequest(gpus=2, gpu_memory_gb=0.3, max_seq_len=2048))
    assert (plan.tp, plan.pp) == (1, 2)
    assert plan.rejected[0] == "tp=2: the 9 attention heads do not divide by it"
    three = make_plan(shape, PlanRequest(gpus=3, gpu_memory_gb=0.3, max_seq_len=2048))
    assert (three.tp, three.pp, three.kv_heads_per_rank) == (3, 1, 1)


def test_tp_beyond_the_kv_heads_replicates_them():
    shape = ModelShape.from_hf(llama(8192, 80, 64, 4, 28672))
    plan = make_plan(shape, PlanRequest(gpus=8, gpu_memory_gb=40))
    assert plan.tp == 8 and plan.kv_heads_per_rank == 1
    assert plan.kv_bytes_per_token_per_rank == 80 * 2 * 1 * 128 * 2
    assert "each rank keeps one, replicated 2 times" in plan.notes[0]
    with pytest.raises(PlanError, match="tp=4/8: the 6 KV heads neither divide by it nor divide it"):
        make_plan(ModelShape.from_hf(llama(8192, 80, 64, 6, 28672)), PlanRequest(gpus=8, gpu_memory_gb=10))


def test_mixtral_gets_expert_parallelism():
    plan = make_plan(ModelShape.from_hf(MIXTRAL_8X7B), PlanRequest(gpus=8))
    assert (plan.tp, plan.ep, plan.dp) == (2, 2, 4)
    assert plan.notes[0] == ("MoE: ep=2: 4 whole experts a rank, attention tensor-parallel over the same 2 ranks "
                             "(kiln compile/serve --ep 2 --tp 2)")
    # One rank would hold all 8 experts whole (tp=1): 93.4 GB of the 68 GB usable.
    assert any(r.startswith("tp=1 pp=1: weights 93.4 GB a rank exceed") for r in plan.rejected)
    # At batch 1 a step reads 2 of the 8 experts of each layer, not all of them.
    assert plan.decode_bytes_per_step < 0.4 * plan.weight_bytes_per_rank
    assert plan.allreduces_per_layer == 2


def test_moe_heads_that_do_not_divide_take_ep_with_attention_replicated():
    """35 heads: no tp > 1 divides them, but the 8 experts split over 2 ranks (tp=1 ep=2), each
    holding the whole attention and KV and half the experts, one all-reduce a layer (the experts')."""
    shape = ModelShape.from_hf({**MIXTRAL_8X7B, "hidden_size": 4480, "num_attention_heads": 35,
                                "num_key_value_heads": 5})
    plan = make_plan(shape, PlanRequest(gpus=4))
    assert (plan.tp, plan.pp, plan.ep, plan.dp) == (1, 1, 2, 2)
    assert plan.kv_heads_per_rank == 5 and plan.allreduces_per_layer == 1
    assert plan.allreduce_bytes_per_step == 32 * 4480 * 1 * 2
    assert plan.notes[0] == ("MoE: ep=2: 4 whole experts a rank, attention and KV replicated on each rank "
                             "(kiln compile/serve --ep 2)")
    one, two = (stages(shape, Layout(1, 1, ep), WeightStorage())[0] for ep in (1, 2))
    assert one.expert_bytes == 2 * two.expert_bytes and one.weight_bytes - one.expert_bytes == \
        two.weight_bytes - two.expert_bytes


def test_moe_experts_that_do_not_divide_stay_whole_on_every_tp_rank():
    """6 experts: tp=4 holds every expert on every rank (ep=1, as shard_tp leaves them), so 4 H100s
    take tp=2 ep=2 (3 experts a rank), the fewest ranks that hold 16 sequences of 4096 tokens."""
    shape = ModelShape.from_hf({**MIXTRAL_8X7B, "num_local_experts": 6})
    assert stages(shape, Layout(4), WeightStorage())[0].expert_bytes == \
        stages(shape, Layout(1), WeightStorage())[0].expert_bytes
    plan = make_plan(shape, PlanRequest(gpus=4, max_seq_len=4096, concurrency=16))
    assert (plan.tp, plan.ep, plan.dp) == (2, 2, 2)


def test_pipeline_stages_hold_the_embedding_first_and_the_head_last():
    shape = ModelShape.from_hf(llama(64, 5, 4, 2, 128, vocab=1000))
    first, last = stages(shape, Layout(pp=2), WeightStorage("fp32"))
    layer = (64 * 64 * 2 + 2 * 32 * 64 + 3 * 64 * 128 + 2 * 64) * 4
    assert (first.layers, last.layers) == (3, 2)
    assert first.weight_bytes == 3 * layer + 1000 * 64 * 4
    assert last.weight_bytes == 2 * layer + 1000 * 64 * 4 + 64 * 4
    assert first.kv_bytes_per_token == 3 * 2 * 2 * 16 * 4


@pytest.mark.parametrize("quantization, expected", [
    (None, 4096 * 4096 * 2),
    ("fp8", 4096 * 4096 + 4096 * 4),            # 1 B a value, an f32 scale a row
    ("w8a8_int8", 4096 * 4096 + 4096 * 4),
    ("mxfp4", 4096 * 4096 // 2 + 4096 * 128),   # half a byte a value, a 1-byte scale per 32 values
])
def test_weight_bytes_by_quantization(quantization, expected):
    assert WeightStorage("bf16", quantization).gemm_bytes(4096, 4096) == expected


def test_bad_requests_name_the_problem():
    shape = ModelShape.from_hf(LLAMA3_8B)
    with pytest.raises(ValueError, match="unknown quantization 'int3'; supported: fp8"):
        make_plan(shape, PlanRequest(quantization="int3"))
    with pytest.raises(ValueError, match="gpus must be at least 1"):
        make_plan(shape, PlanRequest(gpus=0))
    with pytest.raises(ValueError, match="unknown GPU 'a100'; known: h100, h200"):
        make_plan(shape, PlanRequest(gpu="a100"))
    with pytest.raises(ValueError, match="lacks hidden_size"):
        ModelShape.from_hf({"architectures": ["LlamaForCausalLM"]})
