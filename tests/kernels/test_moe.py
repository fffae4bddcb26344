"""The MoE kernels against their references: the router's top-k and the expert-load counter
(``moe_routing.py``), the block-aligned sort by expert, and the two Triton paths of ``moe`` (grouped
GEMMs, per-pair decode GEMVs).

Shapes cover odd token counts, experts no token chose, top-1/2/8, and a rank's slice of the experts
(``expert_offset``, or the ``expert_start`` input shard_ep gives each rank). Kept tiny: they run under Triton's interpreter on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from kiln.ir.types import DType, TensorType
from kiln.kernels import get_impl, select_impl
from kiln.kernels.config import DEFAULTS, KernelConfig
from kiln.kernels.moe import ref_count_experts, ref_moe, ref_router_topk
from kiln.kernels.moe_align import ref_moe_align, triton_moe_align
from kiln.kernels.moe_gemm import moe_decode, moe_grouped, triton_moe
from kiln.kernels.moe_routing import triton_router_topk, triton_router_topk_count

# (tokens, top_k, experts, hidden, intermediate); the decode path is for few pairs, so it gets the
# small ones (the interpreter runs one program per pair and column tile).
SHAPES = [(1, 2, 8, 32, 48), (7, 2, 8, 32, 48), (5, 1, 4, 24, 16), (2, 8, 16, 64, 40)]
CASES = [(moe_grouped, *s) for s in SHAPES + [(13, 8, 16, 64, 40), (3, 8, 8, 40, 24)]] + \
    [(moe_decode, *s) for s in SHAPES + [(3, 8, 16, 40, 24)]]
# Tiles small enough that the decode GEMVs step through K several times, the last step partial.
SMALL_TILES = KernelConfig(gemv_block_n=(4, 4), gemv_block_k=(16, 16), gemv_one_step_max_k=16)


def _routing(tokens: int, top_k: int, experts: int, device: str, skip: int = 0):
    """Routing weights and ids where the last ``skip`` experts are never chosen."""
    logits = torch.randn(tokens, experts, device=device)
    logits[:, experts - skip:] = -1e9
    return ref_router_topk(logits, top_k, renormalize=True)


def _experts(experts: int, hidden: int, inter: int, dtype: torch.dtype, device: str):
    return ((torch.randn(experts, 2 * inter, hidden, device=device) * 0.1).to(dtype),
            (torch.randn(experts, hidden, inter, device=device) * 0.1).to(dtype))


def test_router_topk_ref():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    weights, ids = ref_router_topk(logits, 2)
    assert ids.tolist() == [[1, 2], [2, 3]] and ids.dtype == torch.int32
    torch.testing.assert_close(weights, torch.softmax(logits, -1).topk(2).values)
    weights, _ = ref_router_topk(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))
    with pytest.raises(ValueError, match="scoring 'sigmoid' is not supported"):
        ref_router_topk(logits, 2, scoring="sigmoid")


@pytest.mark.parametrize("tokens, experts, top_k, renormalize", [
    (1, 128, 8, True), (7, 8, 2, False), (5, 4, 1, True), (3, 60, 4, False), (2, 8, 8, True), (0, 8, 2, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_topk_matches_ref(device, tokens, experts, top_k, renormalize, dtype):
    logits = torch.randn(tokens, experts, device=device).to(dtype)
    expected_weights, expected_ids = ref_router_topk(logits, top_k, renormalize)
    weights = torch.full((tokens, top_k), float("nan"), device=device)
    ids = torch.full((tokens, top_k), -1, dtype=torch.int32, device=device)
    triton_router_topk(logits, out=(weights, ids), top_k=top_k, renormalize=renormalize)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("tokens, experts, top_k", [(1, 128, 8), (9, 8, 2), (5, 60, 1), (0, 8, 2)])
def test_router_topk_count_is_the_router_then_the_counter(device, backend, tokens, experts, top_k):
    """The fused op's both implementations against the two references; every third row is padding."""
    logits = torch.randn(tokens, experts, device=device)
    slots = torch.arange(tokens, dtype=torch.int32, device=device)
    slots[::3] = -1
    counts = torch.randint(0, 100, (experts,), device=device)
    expected_weights, expected_ids = ref_router_topk(logits, top_k, renormalize=True)
    expected_counts = ref_count_experts(counts, expected_ids, slots)
    weights = torch.full((tokens, top_k), float("nan"), device=device)
    ids = torch.full((tokens, top_k), -1, dtype=torch.int32, device=device)
    fused = get_impl("torch.router_topk_count").fn if backend == "torch" else triton_router_topk_count
    assert fused(logits, counts, slots, out=(weights, ids), top_k=top_k, renormalize=True) is counts
    assert torch.equal(ids, expected_ids) and torch.equal(counts, expected_counts)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tokens, top_k, experts", [(1, 2, 8), (7, 2, 8), (33, 8, 16), (5, 1, 4), (0, 2, 4)])
@pytest.mark.parametrize("expert_offset", [0, 4])
def test_align_matches_ref(device, tokens, top_k, experts, expert_offset):
    ids = torch.stack([torch.randperm(experts + expert_offset)[:top_k] for _ in range(tokens)]).int() \
        if tokens else torch.empty(0, top_k, dtype=torch.int32)
    expected_pairs, expected_blocks, expected_total = ref_moe_align(ids, experts, 16, expert_offset)
    pairs, blocks, total = triton_moe_align(ids.to(device), experts, 16, expert_offset)
    assert int(total) == expected_total
    assert torch.equal(pairs.cpu(), expected_pairs.cpu())
    assert torch.equal(blocks.cpu(), expected_blocks.cpu())


def test_align_ref_layout():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]], dtype=torch.int32)
    pairs, blocks, total = ref_moe_align(ids, experts=4, block_m=4)
    pad = 6
    assert pairs[:total].tolist() == [1, 4, pad, pad, 0, 2, 5, pad, 3, pad, pad, pad]
    assert blocks[:3].tolist() == [0, 2, 3] and (blocks[3:] == -1).all()


@pytest.mark.parametrize("path, tokens, top_k, experts, hidden, inter", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_paths_match_ref(device, poisoned, assert_matches, path, tokens, top_k, experts, hidden, inter, dtype):
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    w_gate_up, w_down = _experts(experts, hidden, inter, dtype, device)
    weights, ids = _routing(tokens, top_k, experts, device, skip=experts // 4)  # some experts get no token
    out = poisoned((tokens, hidden), dtype)
    path(x, weights, ids, w_gate_up, w_down, out=out)
    assert_matches(out, ref_moe(x, weights, ids, w_gate_up, w_down))


@pytest.mark.parametrize("tokens, top_k, experts, hidden, inter", [(1, 8, 16, 40, 24), (3, 2, 8, 33, 20)])
def test_decode_steps_through_k(device, poisoned, assert_matches, tokens, top_k, experts, hidden, inter):
    """Tiles narrower than K: gate/up takes K=hidden in several steps, down walks every pair's K
    tiles as one sequence; the last tile of each is partial."""
    x = torch.randn(tokens, hidden, device=device)
    w_gate_up, w_down = _experts(experts, hidden, inter, torch.float32, device)
    weights, ids = _routing(tokens, top_k, experts, device, skip=experts // 4)
    out = poisoned((tokens, hidden), torch.float32)
    moe_decode(x, weights, ids, w_gate_up, w_down, out=out, config=SMALL_TILES)
    assert_matches(out, ref_moe(x, weights, ids, w_gate_up, w_down))


@pytest.mark.parametrize("path", [moe_grouped, moe_decode])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_is_added_after_rounding(device, assert_matches, path, dtype):
    """moe_residual: moe's output rounded to the dtype, then the residual added (as the unfused add);
    out may be the residual's own buffer (a memory plan may place it there)."""
    x = torch.randn(5, 32, device=device).to(dtype)
    w_gate_up, w_down = _experts(8, 32, 16, dtype, device)
    weights, ids = _routing(5, 2, 8, device, skip=2)
    residual = torch.randn(5, 32, device=device).to(dtype) * 4
    expected = residual + ref_moe(x, weights, ids, w_gate_up, w_down)
    out = torch.empty_like(x)
    path(x, weights, ids, w_gate_up, w_down, out=out, residual=residual)
    assert_matches(out, expected)
    path(x, weights, ids, w_gate_up, w_down, out=residual, residual=residual)
    assert_matches(residual, expected)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_moe_residual_op(device, assert_matches, backend):
    x = torch.randn(3, 32, device=device)
    w_gate_up, w_down = _experts(8, 32, 16, torch.float32, device)
    weights, ids = _routing(3, 2, 8, device)
    residual = torch.randn(3, 32, device=device)
    types = [TensorType(("T", 32), DType.f32), TensorType(("T", 2), DType.f32), TensorType(("T", 2), DType.i32),
             TensorType((8, 32, 32), DType.f32), TensorType((8, 32, 16), DType.f32), TensorType(("T", 32), DType.f32)]
    impl = select_impl("moe_residual", types, {"expert_offset": 0}, backend)
    assert impl.name == f"{backend}.moe_residual"
    out = torch.empty_like(x)
    impl.fn(x, weights, ids, w_gate_up, w_down, residual, out=out, expert_offset=0)
    assert_matches(out, residual + ref_moe(x, weights, ids, w_gate_up, w_down))


@pytest.mark.parametrize("path", [moe_grouped, moe_decode])
def test_expert_slices_sum_to_the_whole(device, poisoned, assert_matches, path):
    """Two ranks' halves of the experts (expert_offset 0 and 4) add up to all eight: what an
    all-reduce after expert-parallel moe ops computes."""
    x = torch.randn(5, 32, device=device)
    w_gate_up, w_down = _experts(8, 32, 16, torch.float32, device)
    weights, ids = _routing(5, 2, 8, device)
    halves = []
    for offset in (0, 4):
        out = poisoned((5, 32), torch.float32)
        path(x, weights, ids, w_gate_up[offset:offset + 4], w_down[offset:offset + 4], out=out, expert_offset=offset)
        assert_matches(out, ref_moe(x, weights, ids, w_gate_up[offset:offset + 4], w_down[offset:offset + 4], offset))
        halves.append(out)
    assert_matches(halves[0] + halves[1], ref_moe(x, weights, ids, w_gate_up, w_down))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_expert_start_input_selects_the_rank_slice(device, assert_matches, backend):
    """What shard_ep emits: the rank's first expert as an i32[1] input (a per-rank weight), not an
    attribute; both registry implementations shift the ids by it."""
    x = torch.randn(3, 32, device=device)
    w_gate_up, w_down = _experts(8, 32, 16, torch.float32, device)
    weights, ids = _routing(3, 2, 8, device)
    types = [TensorType(("T", 32), DType.f32), TensorType(("T", 2), DType.f32), TensorType(("T", 2), DType.i32),
             TensorType((4, 32, 32), DType.f32), TensorType((4, 32, 16), DType.f32), TensorType((1,), DType.i32)]
    impl = select_impl("moe", types, {"expert_offset": 0}, backend)
    out = torch.empty_like(x)
    start = torch.tensor([4], dtype=torch.int32, device=device)
    impl.fn(x, weights, ids, w_gate_up[4:], w_down[4:], start, out=out, expert_offset=0)
    assert_matches(out, ref_moe(x, weights, ids, w_gate_up[4:], w_down[4:], 4))


def test_dispatch_by_pair_count(device, assert_matches):
    """triton_moe takes the decode path up to moe_decode_max_pairs pairs and the grouped one above."""
    w_gate_up, w_down = _experts(8, 32, 16, torch.float32, device)
    for tokens in (DEFAULTS.moe_decode_max_pairs // 2, DEFAULTS.moe_decode_max_pairs // 2 + 1):
        x = torch.randn(tokens, 32, device=device)
        weights, ids = _routing(tokens, 2, 8, device)
        out = torch.empty_like(x)
        triton_moe(x, weights, ids, w_gate_up, w_down, out=out)
        assert_matches(out, ref_moe(x, weights, ids, w_gate_up, w_down))


def test_registry_picks_triton_for_float_moe_and_routing():
    types = [TensorType(("T", 32), DType.bf16), TensorType(("T", 2), DType.f32), TensorType(("T", 2), DType.i32),
             TensorType((8, 32, 32), DType.bf16), TensorType((8, 32, 16), DType.bf16)]
    assert select_impl("moe", types, {"expert_offset": 0}, "triton").name == "triton.moe"
    assert select_impl("moe", types, {"expert_offset": 0}, "torch").name == "torch.moe"
    attrs = {"top_k": 2, "renormalize": False, "scoring": "softmax"}
    assert select_impl("router_topk", types[:1], attrs, "triton").name == "triton.router_topk"
    # The counter alone stays on torch (fused into its router, it never runs alone in a pipeline's graph).
    counter = [TensorType((8,), DType.i64), TensorType(("T", 2), DType.i32), TensorType(("T",), DType.i32)]
    assert select_impl("count_experts", counter, {}, "triton").name == "torch.count_experts"
    fused = [types[0], counter[0], counter[2]]
    assert select_impl("router_topk_count", fused, attrs, "triton").name == "triton.router_topk_count"


def test_rejects_bad_inputs(device):
    x = torch.randn(3, 32, device=device)
    w_gate_up, w_down = _experts(4, 32, 16, torch.float32, device)
    weights, ids = _routing(3, 2, 4, device)
    with pytest.raises(ValueError, match="weights f32"):
        moe_grouped(x, weights.half(), ids, w_gate_up, w_down, out=torch.empty_like(x))
    with pytest.raises(ValueError, match="w_down must be contiguous"):
        moe_decode(x, weights, ids, w_gate_up, w_down.transpose(1, 2).contiguous().transpose(1, 2),
                   out=torch.empty_like(x))
