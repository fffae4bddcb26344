"""Weight recipes against torch computed by hand: concat, a rank's slice, the reference quantizers,
one recipe list applied lazily through recipes that feed each other, and the weight store making a
quantized parameter through its recipe."""

import pytest
import torch

from kiln.kernels.quantize import dequantize, quantize
from kiln.compiler.recipes import (Concat, Constant, Quantize, Shard, Slice, Stack, apply_recipes, for_rank,
                                   source_names)
from kiln.compiler.sources.hf import MemoryTensors, SourceError
from kiln.compiler.weights import WeightStore
from kiln.ir import DType, GraphBuilder, TensorType
from kiln.ir.weights import SCHEMES, WeightFormat

INT8 = SCHEMES["int8_channel"]


def make(recipes, sources, *names):
    reads = []

    def read(name):
        reads.append(name)
        return sources[name]

    return dict(apply_recipes(recipes, names, read)), reads


def test_concat_and_slice():
    q, k = torch.arange(6.0).reshape(2, 3), torch.arange(6.0, 9.0).reshape(1, 3)
    recipes = [Concat("qk", ("q", "k"), axis=0), Slice("qk.rank1", "qk", axis=1, index=1, count=3)]
    made, _ = make(recipes, {"q": q, "k": k}, "qk", "qk.rank1")
    assert torch.equal(made["qk"], torch.tensor([[0.0, 1, 2], [3, 4, 5], [6, 7, 8]]))
    assert torch.equal(made["qk.rank1"], torch.tensor([[1.0], [4], [7]]))
    with pytest.raises(ValueError, match="does not split into 2 equal shards"):
        make([Slice("s", "q", axis=1, index=0, count=2)], {"q": q}, "s")


def test_a_cyclic_shard_of_two_blocks_takes_each_blocks_part():
    """shard_ep at tp > ep: rank r takes part r % parts of the gate rows and of the up rows alike."""
    gate_up = torch.arange(8.0).reshape(8, 1)  # gate rows 0-3, up rows 4-7
    shard = Shard("gu.shard", "gu", axis=0, parts=2, ranks=4, cyclic=True, groups=2)
    assert [shard.for_rank(r).index for r in range(4)] == [0, 1, 0, 1]
    made, _ = make([shard.for_rank(3)], {"gu": gate_up}, "gu.shard")
    assert made["gu.shard"].flatten().tolist() == [2.0, 3.0, 6.0, 7.0]
    with pytest.raises(ValueError, match="does not split into 2 blocks x 4 equal shards"):
        make([Slice("s", "gu", axis=0, index=0, count=4, groups=2)], {"gu": gate_up[:6]}, "s")


def test_stack_of_concats_makes_an_expert_weight():
    """An MoE layer's [E, 2I, H] gate/up weight: each expert's gate and up rows joined, then stacked."""
    sources = {f"{kind}{e}": torch.full((2, 3), float(10 * e + i)) for e in range(2) for i, kind in enumerate("gu")}
    recipes = [Concat(f"gu{e}", (f"g{e}", f"u{e}")) for e in range(2)] + [Stack("experts", ("gu0", "gu1"))]
    made, reads = make(recipes, sources, "experts")
    assert made["experts"].shape == (2, 4, 3)
    assert made["experts"][:, :, 0].tolist() == [[0, 0, 1, 1], [10, 10, 11, 11]]
    assert source_names(recipes, ["experts"]) == ["g0", "u0", "g1", "u1"] == reads
    with pytest.raises(ValueError, match="cannot stack tensors of shapes"):
        make([Stack("s", ("g0", "x"))], {"g0": sources["g0"], "x": torch.zeros(3)}, "s")


def test_int8_per_channel_by_hand():
    w = torch.tensor([[1.0, -2.0, 0.5], [0.25, 0.0, 0.0], [0.0, 0.0, 0.0]])
    values, (scale,) = quantize(w, INT8)
    # Row scale = largest magnitude / 127; values round half to even (63.5 -> 64).
    assert torch.equal(scale, torch.tensor([2 / 127, 0.25 / 127, 1.0]))
    assert torch.equal(values, torch.tensor([[64, -127, 32], [127, 0, 0], [0, 0, 0]], dtype=torch.int8))
    assert torch.allclose(dequantize(values, (scale,), INT8), w, atol=scale.max().item() / 2)


def test_fp8_per_channel_keeps_each_row_within_its_scale():
    w = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    values, (scale,) = quantize(w, SCHEMES["fp8_channel"])
    assert values.dtype == torch.float8_e4m3fn and torch.equal(scale, w.abs().amax(dim=1) / 448)
    assert values.float().abs().amax(dim=1).eq(448).all()
    # e4m3 keeps 3 mantissa bits (a relative error of at most 2^-4); its subnormals are 2^-9 apart.
    error = (dequantize(values, (scale,), SCHEMES["fp8_channel"]) - w).abs()
    assert (error <= w.abs() / 16 + scale[:, None] * 2 ** -10).all()


def test_mxfp4_by_hand():
    # One block of 32: largest magnitude 6 gives exponent floor(log2 6) - 2 = 0 (stored 127).
    block = torch.zeros(32)
    block[:6] = torch.tensor([6.0, -0.5, 2.4, 7.0, -0.2, 1.25])
    values, (scale,) = quantize(block.reshape(1, 32), SCHEMES["mxfp4"])
    assert scale.tolist() == [[127]]
    # Codes: 6 -> 7; -0.5 -> sign|1 = 9; 2.4 -> 2 (4); 7 -> 6 (7); -0.2 -> -0 (8); 1.25 -> 1 (2, a tie to the smaller).
    assert values.shape == (1, 16) and values[0, :3].tolist() == [7 | 9 << 4, 4 | 7 << 4, 8 | 2 << 4]
    expected = block.clone()
    expected[:6] = torch.tensor([6.0, -0.5, 2.0, 6.0, 0.0, 1.0])
    assert torch.equal(dequantize(values, (scale,), SCHEMES["mxfp4"]), expected.reshape(1, 32))
    # A second block of small values shares a smaller power of two.
    _, (scales,) = quantize(torch.cat([block, block / 64]).reshape(1, 64), SCHEMES["mxfp4"])
    assert scales.tolist() == [[127, 121]]


def test_recipes_feed_each_other_and_run_once():
    sources = {"a": torch.tensor([[1.0, -2.0]]), "b": torch.tensor([[4.0, 1.0]])}
    fmt = WeightFormat(INT8, ("ab.scale",))
    recipes = [Quantize("ab", "ab.f32", fmt), Concat("ab.f32", ("a", "b"))]
    made, reads = make(recipes, sources, "ab.scale", "ab")
    assert reads == ["a", "b"]
    assert torch.equal(made["ab.scale"], torch.tensor([2 / 127, 4 / 127]))
    assert torch.equal(made["ab"], torch.tensor([[64, -127], [127, 32]], dtype=torch.int8))
    assert source_names(recipes, ["ab", "ab.scale", "c"]) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="made by two recipes"):
        make(recipes + [Concat("ab", ("a",))], sources, "ab")


def test_the_weight_store_quantizes_through_a_recipe_and_never_by_a_cast():
    b = GraphBuilder("g")
    b.param("w.scale", TensorType((2,), DType.f32))
    w = b.param("w", TensorType((2, 2), DType.i8), WeightFormat(INT8, ("w.scale",)))
    b.output(b.op("linear", b.input("x", TensorType(("T", 2), DType.f32)), w))
    graph = b.build()
    source = torch.tensor([[1.0, -2.0], [4.0, 1.0]])
    recipe = Quantize("w", "w.f32", WeightFormat(INT8, ("w.scale",)))
    made = dict(WeightStore(MemoryTensors({"w.f32": source}), {}, [recipe], "src").materialize(graph))
    assert torch.equal(made["w"], torch.tensor([[64, -127], [127, 32]], dtype=torch.int8))
    assert torch.equal(made["w.scale"], torch.tensor([2 / 127, 4 / 127]))
    with pytest.raises(SourceError, match="int8_channel weight 'w' comes as torch.float32"):
        dict(WeightStore(MemoryTensors({"w": source, "w.scale": torch.ones(2)}), {}, [], "src").materialize(graph))


def test_shard_gives_each_rank_its_part_and_replicates_fewer_parts():
    source = torch.arange(12.0).reshape(4, 3)
    split = Shard("w.shard", "w", 0, 4, 4)
    assert [split.for_rank(r) for r in range(2)] == [Slice("w.shard", "w", 0, 0, 4), Slice("w.shard", "w", 0, 1, 4)]
    replicated = Shard("w.shard", "w", 0, 2, 4)  # 2 parts over 4 ranks: ranks 0-1 hold part 0, ranks 2-3 part 1
    made = [dict(apply_recipes(for_rank([replicated], r), ["w.shard"], {"w": source}.get))["w.shard"]
            for r in range(4)]
    assert torch.equal(made[0], source[:2]) and torch.equal(made[1], source[:2]) and torch.equal(made[3], source[2:])
    with pytest.raises(ValueError, match="3 parts cannot be spread evenly over 4 ranks"):
        Shard("w.shard", "w", 0, 3, 4)


def test_constant_makes_its_int32_values():
    ((name, tensor),) = apply_recipes([Constant("starts", (0, 8))], ["starts"], {}.get)
    assert name == "starts" and tensor.dtype == torch.int32 and tensor.tolist() == [0, 8]
