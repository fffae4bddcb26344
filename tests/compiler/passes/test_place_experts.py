"""Before/Expected IR test of the redundant-expert pass (4 experts in 6 slots: experts 1 and 2 have
two copies), its recipes (the model's stacks reordered by slot, the copy table), the copy each row
picks, its refusals, and the balancing that makes a placement from measured loads."""

import pytest
import torch

from kiln.compiler.expert_placement import balance, placements_from_loads, rank_loads
from kiln.compiler.passes.base import PassContext
from kiln.compiler.passes.place_experts import place_experts
from kiln.compiler.passes.shard_ep import shard_ep
from kiln.compiler.recipes import Constant, Stack
from kiln.ir import parse_graph, print_graph, verify
from kiln.kernels.moe import ref_place_experts
from tests.compiler.passes.test_count_expert_load import BODY, HEAD

from .ir_text import dedent


EXPERTS = """
      param @l0.mlp.experts.gate_up_proj: f32[4, 12, 8]
      param @l0.mlp.experts.down_proj: f32[4, 8, 6]
"""
BEFORE = dedent(HEAD + EXPERTS + BODY + """
      %l0.experts = moe(%l0.mlp_in, %l0.route_w, %l0.route_ids, @l0.mlp.experts.gate_up_proj, @l0.mlp.experts.down_proj) {expert_offset=0} : f32[T, 8]
      return %l0.experts
    }
""")
EXPECTED = dedent(HEAD + """      param @l0.mlp.gate.weight: f32[4, 8]
      param @l0.mlp.experts.gate_up_proj.placement: i32[4, 2]
      param @l0.mlp.experts.gate_up_proj.placed: f32[6, 12, 8]
      param @l0.mlp.experts.down_proj.placed: f32[6, 8, 6]
      %l0.attn = paged_attention(%q, %k_cache.0, %v_cache.0, %q_start, %q_len, %kv_len, %page_table) {page_size=4, scale=0.5, sliding_window=0, soft_cap=0.0} : f32[T, 2, 4]
      %l0.mlp_in = reshape(%l0.attn) {shape=["T", 8]} : f32[T, 8]
      %l0.router = linear(%l0.mlp_in, @l0.mlp.gate.weight) : f32[T, 4]
      %l0.route_w, %l0.route_ids = router_topk(%l0.router) {renormalize=true, scoring="softmax", top_k=2} : f32[T, 2], i32[T, 2]
      %l0.route_ids.placed = place_experts(%l0.route_ids, @l0.mlp.experts.gate_up_proj.placement) : i32[T, 2]
      %l0.experts = moe(%l0.mlp_in, %l0.route_w, %l0.route_ids.placed, @l0.mlp.experts.gate_up_proj.placed, @l0.mlp.experts.down_proj.placed) {expert_offset=0} : f32[T, 8]
      return %l0.experts
    }
""")
PLACEMENT = (1, 0, 2, 1, 3, 2)  # rank 0 of 2: experts 1, 0, 2; rank 1: 1, 3, 2


def stacks() -> list[Stack]:
    return [Stack("l0.mlp.experts.gate_up_proj", tuple(f"gu{e}" for e in range(4))),
            Stack("l0.mlp.experts.down_proj", tuple(f"down{e}" for e in range(4)))]


def test_place_experts():
    ctx = PassContext(recipes=stacks(), expert_placement=((0, PLACEMENT),))
    graph = parse_graph(BEFORE)
    verify(graph)
    after = place_experts(graph, ctx)
    verify(after)
    assert print_graph(after) == EXPECTED
    assert Stack("l0.mlp.experts.gate_up_proj.placed", ("gu1", "gu0", "gu2", "gu1", "gu3", "gu2")) in ctx.recipes
    # Expert e's slots, repeated to two columns: row t takes column t % 2.
    table = Constant("l0.mlp.experts.gate_up_proj.placement", ((1, 1), (0, 3), (2, 5), (4, 4)))
    assert table in ctx.recipes
    ids = torch.tensor([[1, 2], [1, 3], [0, 2]], dtype=torch.int32)
    assert ref_place_experts(ids, table.make([])[0]).tolist() == [[0, 2], [3, 4], [1, 2]]
    # shard_ep then slices the six slots over two ranks: three a rank.
    text = print_graph(shard_ep(after, PassContext(ep=2, recipes=ctx.recipes)))
    assert "param @l0.mlp.experts.gate_up_proj.placed.shard: f32[3, 12, 8] placement=expert(0)" in text


def test_refuses_a_placement_that_drops_an_expert_or_names_no_sparse_layer():
    with pytest.raises(ValueError, match=r"layer 0: every one of the 4 experts must have a slot"):
        place_experts(parse_graph(BEFORE), PassContext(recipes=stacks(), expert_placement=((0, (0, 1, 2, 2)),)))
    with pytest.raises(ValueError, match=r"names layer\(s\) \[3\] without routed experts; sparse layers: \[0\]"):
        place_experts(parse_graph(BEFORE), PassContext(recipes=stacks(), expert_placement=((3, PLACEMENT),)))


def test_balance_replicates_the_hottest_experts_and_evens_the_ranks():
    loads = [900, 100, 80, 60, 40, 20, 500, 300]
    contiguous = rank_loads(tuple(range(8)), loads, 2)
    placement = balance(loads, redundant=2, ranks=2)
    assert len(placement) == 10 and set(placement) == set(range(8))
    assert placement.count(0) == 2 and placement.count(6) == 2  # the two hottest got the copies
    balanced = rank_loads(placement, loads, 2)
    assert sum(balanced) == pytest.approx(sum(loads))
    assert max(balanced) < max(contiguous) and max(balanced) - min(balanced) <= 100
    assert placements_from_loads({1: loads}, 2, 2) == ((1, placement),)
    with pytest.raises(ValueError, match="8 experts \\+ 1 redundant = 9 slots do not split evenly over 2"):
        balance(loads, redundant=1, ranks=2)
