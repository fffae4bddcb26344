"""Before/Expected IR test of the expert-load pass (a router after a layer's attention), the layer
labels of a real Qwen2-MoE graph (layer 0 dense, so its one sparse layer is layer 1), the counting
op's kernel against its reference (padding rows count nothing), and dense models left alone."""

import torch

from kiln.compiler.passes.base import PassContext
from kiln.compiler.passes.count_expert_load import count_expert_load
from kiln.compiler.pipeline import run_pipeline
from kiln.ir import parse_graph, print_graph, verify
from kiln.kernels import get_impl
from kiln.kernels.moe import ref_count_experts
from tests.compiler.passes.test_shard_ep import _qwen2_moe_graph

from .ir_text import dedent


HEAD = """
    graph Qwen3MoeForCausalLM {
      input %slots: i32[T]
      input %q: f32[T, 2, 4]
      input %q_start: i32[B]
      input %q_len: i32[B]
      input %kv_len: i32[B]
      input %page_table: i32[B, P]
      input %k_cache.0: f32[NS, 2, 4]
      input %v_cache.0: f32[NS, 2, 4]
"""
BODY = """
      param @l0.mlp.gate.weight: f32[4, 8]
      %l0.attn = paged_attention(%q, %k_cache.0, %v_cache.0, %q_start, %q_len, %kv_len, %page_table) {page_size=4, scale=0.5, sliding_window=0, soft_cap=0.0} : f32[T, 2, 4]
      %l0.mlp_in = reshape(%l0.attn) {shape=["T", 8]} : f32[T, 8]
      %l0.router = linear(%l0.mlp_in, @l0.mlp.gate.weight) : f32[T, 4]
      %l0.route_w, %l0.route_ids = router_topk(%l0.router) {renormalize=true, scoring="softmax", top_k=2} : f32[T, 2], i32[T, 2]
"""
BEFORE = dedent(HEAD + BODY + """
      return %l0.route_w
    }
""")
EXPECTED = dedent(HEAD + "      input %expert_load.0: i64[4]" + BODY + """      %expert_load.0.counted = count_experts(%expert_load.0, %l0.route_ids, %slots) : i64[4]
      return %l0.route_w
    }
""")


def test_count_expert_load():
    graph = parse_graph(BEFORE)
    verify(graph)
    after = count_expert_load(graph, PassContext())
    verify(after)
    assert print_graph(after) == EXPECTED


def test_sparse_layers_are_labelled_by_their_decoder_layer_and_survive_the_pipeline():
    graph, _ = run_pipeline(_qwen2_moe_graph(), PassContext(symbol_bounds={"T": 8, "B": 2, "N": 2, "P": 16}))
    assert [name for name in graph.inputs if name.startswith("expert_load.")] == ["expert_load.1"]
    ops = [node.op for node in graph.nodes]  # the counter joined its router (fuse_router_count), kept by dce
    assert ops.count("router_topk_count") == 1 and "count_experts" not in ops and "router_topk" not in ops


def test_a_dense_model_is_left_alone():
    dense = parse_graph(dedent(HEAD + """
          param @w: f32[8, 8]
          %x = reshape(%q) {shape=["T", 8]} : f32[T, 8]
          %y = linear(%x, @w) : f32[T, 8]
          return %y
        }
    """))
    assert count_expert_load(dense, PassContext()) is dense


def test_the_counting_kernel_matches_its_reference_and_skips_padding_rows():
    ids = torch.tensor([[3, 0], [3, 1], [2, 3], [0, 1], [7, 6]], dtype=torch.int32)
    slots = torch.tensor([4, 9, -1, 0, 2], dtype=torch.int32)  # row 2 is padding
    counts = torch.arange(8, dtype=torch.int64)
    expected = ref_count_experts(counts, ids, slots)
    assert expected.tolist() == [0 + 2, 1 + 2, 2, 3 + 2, 4, 5, 6 + 1, 7 + 1]
    assert get_impl("torch.count_experts").fn(counts, ids, slots) is counts  # in place
    assert counts.tolist() == expected.tolist()
