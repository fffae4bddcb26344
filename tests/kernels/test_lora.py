"""The LoRA ops' kernels: ref_lora (ref_lora_shrink then ref_lora_expand) against a per-sequence loop,
the Triton shrink and expand (one row split over K; several rows, decode or prefill, in tiles of one
adapter from the step's grouping) against the references."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.config import DEFAULTS, KernelConfig
from kiln.kernels.lora import ref_lora_expand, ref_lora_shrink, triton_lora_expand, triton_lora_shrink
from kiln.kernels.lora_groups import ref_lora_groups
from kiln.kernels.triton_support import semaphore_counters, side_lane


def ref_lora(y, x, lora_a, lora_b, rows, tiles, slices, norm_weight=None, prologue="none", eps=0.0):
    """A hook's whole update by the references, shrink then expand: (y plus each row's update, h)."""
    h = ref_lora_shrink(x, lora_a, rows, tiles, norm_weight, prologue, eps)
    return ref_lora_expand(y, h, lora_b, rows, tiles, slices), h


def triton_lora(y, x, lora_a, lora_b, rows, tiles, norm_weight=None, *, out, slices, prologue="none", eps=0.0,
                config=DEFAULTS):
    """A hook as the program runs it: the shrink into ``out`` (h), then the expand into y."""
    triton_lora_shrink(x, lora_a, rows, tiles, norm_weight, out=out, prologue=prologue, eps=eps, config=config)
    triton_lora_expand(y, out, lora_b, rows, tiles, slices=slices, config=config)


def _per_sequence(y, x, lora_a, lora_b, slots, lengths, slices):
    """The update written the obvious way: sequence by sequence, slice by slice, in f32."""
    out, rank, row = y.float().clone(), lora_b.shape[2], 0
    for slot, length in zip(slots, lengths):
        rows = slice(row, row + length)
        row += length
        if slot < 0:
            continue
        h = x[rows].float() @ lora_a[slot].float().T
        start = 0
        for i, width in enumerate(slices):
            out[rows, start:start + width] += h[:, i * rank:(i + 1) * rank] @ lora_b[slot, start:start + width].float().T
            start += width
    return out.to(y.dtype)


def _inputs(lengths, slots, slices, in_features, rank, num_slots, dtype, device):
    tokens = sum(lengths)
    x = torch.randn(tokens, in_features, device=device).to(dtype)
    y = torch.randn(tokens, sum(slices), device=device).to(dtype)
    lora_a = (torch.randn(num_slots, len(slices) * rank, in_features, device=device) / in_features ** 0.5).to(dtype)
    lora_b = torch.randn(num_slots, sum(slices), rank, device=device).to(dtype)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    ints = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    rows, tiles = ref_lora_groups(ints(slots), ints(starts), ints(lengths), tokens, num_slots)
    return y, x, lora_a, lora_b, rows, tiles


CASES = [
    # (sequence lengths, slot per sequence, slices, in_features, rank, slots)
    ([1, 1, 1, 1], [0, -1, 2, 0], [24], 40, 8, 3),                # decode: one row a sequence
    ([1, 1, 1], [1, 0, -1], [48, 16, 16], 48, 16, 2),             # decode, fused q/k/v
    ([5, 17, 3], [0, -1, 1], [40, 40], 33, 4, 2),                 # prefill, gate/up, odd sizes
    ([20, 1, 1, 9], [2, 0, -1, 2], [96, 32, 32], 72, 16, 3),      # mixed prefill and decode
    ([7, 0, 2], [1, 1, 0], [70], 130, 5, 2),                      # a padding sequence (no tokens)
]


@pytest.mark.parametrize("lengths,slots,slices,in_features,rank,num_slots", CASES)
def test_ref_lora_is_the_per_sequence_update(lengths, slots, slices, in_features, rank, num_slots, device):
    y, x, a, b, rows, tiles = _inputs(lengths, slots, slices, in_features, rank, num_slots, torch.float32, device)
    updated, h = ref_lora(y, x, a, b, rows, tiles, slices)
    torch.testing.assert_close(updated, _per_sequence(y, x, a, b, slots, lengths, slices), rtol=1e-5, atol=1e-4)
    base_rows = torch.cat([torch.full((n,), s < 0) for s, n in zip(slots, lengths)])
    assert (h[base_rows] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths,slots,slices,in_features,rank,num_slots", CASES)
def test_triton_lora_matches_ref(lengths, slots, slices, in_features, rank, num_slots, dtype, device, assert_matches):
    y, x, a, b, rows, tiles = _inputs(lengths, slots, slices, in_features, rank, num_slots, dtype, device)
    expected, _ = ref_lora(y, x, a, b, rows, tiles, slices)
    h = torch.empty(x.shape[0], a.shape[1], dtype=torch.float32, device=device)
    triton_lora(y, x, a, b, rows, tiles, out=h, slices=slices)
    assert_matches(y, expected)


@pytest.mark.parametrize("prologue", ["none", "rmsnorm"])
def test_an_adapters_tiles_span_sequences(prologue, device, assert_matches):
    """Prefill and decode rows of one adapter across four sequences: two tiles of slot 1 whose rows
    come from three sequences, one partial tile of slot 0; h holds the adapter rows' shrink."""
    lengths, slots = [6, 10, 20, 1, 3], [1, 0, 1, -1, 1]
    y, x, a, b, rows, tiles = _inputs(lengths, slots, [32, 20], 48, 8, 2, torch.float32, device)
    norm = 1 + 0.1 * torch.randn(48, device=device) if prologue == "rmsnorm" else None
    expected, expected_h = ref_lora(y, x, a, b, rows, tiles, [32, 20], norm, prologue, 1e-5)
    h = torch.full((x.shape[0], a.shape[1]), float("nan"), device=device)
    triton_lora(y, x, a, b, rows, tiles, norm, out=h, slices=[32, 20], prologue=prologue, eps=1e-5)
    assert_matches(y, expected)
    adapter_rows = torch.cat([torch.full((n,), s >= 0) for s, n in zip(slots, lengths)])
    assert_matches(h[adapter_rows], expected_h[adapter_rows])


def test_decode_shrink_splits_k_at_few_rows(device, assert_matches):
    """One row and a long K: the shrink splits K over programs (the interpreter counts 4 SMs) and
    sums into h; the update still equals the reference."""
    y, x, a, b, rows, tiles = _inputs([1], [1], [32, 16], 1000, 8, 2, torch.float32, device)
    expected, expected_h = ref_lora(y, x, a, b, rows, tiles, [32, 16])
    h = torch.full((1, 16), float("nan"))
    triton_lora(y, x, a, b, rows, tiles, out=h, slices=[32, 16])
    assert_matches(y, expected)
    assert_matches(h, expected_h)


@pytest.mark.parametrize("prologue", ["rmsnorm", "silu_mul"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths,slots", [([1, 1, 1], [0, -1, 1]), ([6, 19, 1], [1, 0, -1])])
def test_prologues_make_the_gemm_input_as_the_unfused_ops_do(prologue, dtype, lengths, slots, device, assert_matches):
    """x is the RMSNorm's input (with its weight) or the gate/up output; decode and prefill layouts."""
    in_features = 40
    y, x, a, b, rows, tiles = _inputs(lengths, slots, [24, 24], in_features, 8, 2, dtype, device)
    # Updates of about y's size: the prologue rounds its input to bf16 where the references do, but the
    # interpreter truncates instead of rounding, and a last-bit difference of the input scaled by a
    # large B would exceed bf16's tolerance without saying anything about the kernel.
    b = b * 0.1
    norm = None
    if prologue == "rmsnorm":
        x = x * 3
        norm = (1 + 0.1 * torch.randn(in_features, device=device)).to(dtype)
    else:
        x = torch.randn(x.shape[0], 2 * in_features, device=device).to(dtype)
    expected, _ = ref_lora(y, x, a, b, rows, tiles, [24, 24], norm, prologue, 1e-5)
    plain = x if prologue == "rmsnorm" else x[:, :in_features].contiguous()
    assert not torch.allclose(expected.float(), ref_lora(y, plain, a, b, rows, tiles, [24, 24])[0].float())
    h = torch.empty(x.shape[0], a.shape[1], dtype=torch.float32, device=device)
    triton_lora(y, x, a, b, rows, tiles, norm, out=h, slices=[24, 24], prologue=prologue, eps=1e-5)
    assert_matches(y, expected)


DECODE_CASES = [
    # (sequences, slot of each, slices, in_features, rank, slots): one token a sequence
    (1, [1], [600], 1000, 16, 2),                                   # split K, a run of column blocks
    (3, [0, -1, 2], [48, 16, 16], 130, 8, 3),                       # fused q/k/v, odd K
    (17, [i % 4 - 1 for i in range(17)], [301, 301], 77, 64, 3),    # gate/up, rank 64, odd N
    (64, [i % 9 - 1 for i in range(64)], [72], 200, 16, 8),         # 8 adapters and the base model
    (17, [2] * 17, [40, 24, 24], 96, 16, 3),                        # every row on one adapter
    (5, [-1] * 5, [70], 50, 8, 2),                                  # no adapter at all: y unchanged
    (6, [0, -1, 0, 0, -1, 0], [40, 24], 700, 16, 1),                # one adapter's tile, K split in planes
    (50, [i % 2 if i % 5 else -1 for i in range(50)], [33], 600, 8, 2),  # two tiles an adapter
    (20, [0] * 19 + [-1], [33, 33, 20], 600, 8, 1),                 # two tiles of one adapter, K split
    (64, [i % 8 for i in range(64)], [96, 32, 32], 1000, 16, 8),    # 8 adapters interleaved, 8 rows each
    (64, [(i % 4) * 2 for i in range(64)], [150], 1000, 16, 8),     # slots 1, 3, 5, 7 without rows
]


@pytest.mark.parametrize("prologue", ["none", "rmsnorm", "silu_mul"])
@pytest.mark.parametrize("count,slots,slices,in_features,rank,num_slots", DECODE_CASES)
def test_decode_kernels_match_ref(count, slots, slices, in_features, rank, num_slots, prologue, device, assert_matches):
    """The decode layouts (shrink split over K into planes that each unit's last split adds into h,
    the expand walking runs of column blocks) at several batch sizes, ranks, slice counts and
    prologues; h holds each adapter row's shrink result."""
    y, x, a, b, rows, tiles = _inputs([1] * count, slots, slices, in_features, rank, num_slots, torch.float32,
                                      device)
    norm = None
    if prologue == "rmsnorm":
        norm = 1 + 0.1 * torch.randn(in_features, device=device)
    elif prologue == "silu_mul":
        x = torch.randn(count, 2 * in_features, device=device)
    expected, expected_h = ref_lora(y, x, a, b, rows, tiles, slices, norm, prologue, 1e-5)
    h = torch.full((count, a.shape[1]), float("nan"), device=device)
    triton_lora(y, x, a, b, rows, tiles, norm, out=h, slices=slices, prologue=prologue, eps=1e-5)
    assert_matches(y, expected)
    adapter_rows = torch.tensor(slots) >= 0
    assert_matches(h[adapter_rows], expected_h[adapter_rows])
    assert not semaphore_counters(h.device, 1).any(), "the last split of each unit puts its counter back to zero"


def test_decode_split_rmsnorm_in_bf16(device, assert_matches):
    """Tiles of one adapter with K split and the RMSNorm prologue, in bf16: the norm's 1/rms scales
    the summed planes (the unfused norm rounds the normalized input instead: within bf16 tolerance)."""
    y, x, a, b, rows, tiles = _inputs([1] * 6, [0, -1, 0, 0, 0, -1], [32, 32], 1024, 8, 1, torch.bfloat16, device)
    x, b = x * 3, b * 0.1  # (as in the prologue test above: updates about y's size)
    norm = (1 + 0.1 * torch.randn(1024, device=device)).to(torch.bfloat16)
    expected, _ = ref_lora(y, x, a, b, rows, tiles, [32, 32], norm, "rmsnorm", 1e-5)
    h = torch.empty(6, 16, dtype=torch.float32, device=device)
    triton_lora(y, x, a, b, rows, tiles, norm, out=h, slices=[32, 32], prologue="rmsnorm", eps=1e-5)
    assert_matches(y, expected)


@pytest.mark.parametrize("lengths,slots", [([1], [0]), ([1] * 21, [i % 3 - 1 for i in range(21)]), ([9, 14], [1, 0])])
@pytest.mark.parametrize("settings", [dict(lora_max_splits=1, lora_expand_steps=1),
                                      dict(lora_tile_block_k=16, lora_tile_block_n=32, lora_min_split_k=16,
                                           lora_row_block_k=32, lora_norm_block=64, lora_expand_programs_per_sm=8),
                                      # 19 splits, merged 4 planes at a time (the last group cut short)
                                      dict(lora_tile_block_k=16, lora_min_split_k=16, lora_row_block_k=16,
                                           lora_shrink_programs_per_sm=16, lora_merge_planes=4,
                                           lora_shrink_stages=2)])
def test_kernel_config_reshapes_the_launches_not_the_update(lengths, slots, settings, device, assert_matches):
    """The LoRA knobs of KernelConfig (no split and one block a program; small blocks, many splits)."""
    y, x, a, b, rows, tiles = _inputs(lengths, slots, [40, 24], 300, 8, 2, torch.float32, device)
    norm = 1 + 0.1 * torch.randn(300, device=device)
    expected, _ = ref_lora(y, x, a, b, rows, tiles, [40, 24], norm, "rmsnorm", 1e-5)
    h = torch.empty(x.shape[0], a.shape[1], dtype=torch.float32, device=device)
    triton_lora(y, x, a, b, rows, tiles, norm, out=h, slices=[40, 24], prologue="rmsnorm", eps=1e-5,
                config=KernelConfig().with_settings(settings))
    assert_matches(y, expected)


def test_a_shrink_on_the_side_lane_takes_counters_of_its_own(device, assert_matches):
    """Launched inside ``side_lane()`` (the step's side stream), the split-K shrink counts on the side
    lane's counter buffer, which it leaves at zero; the main lane's buffer is another tensor."""
    y, x, a, b, rows, tiles = _inputs([1], [1], [32, 16], 1000, 8, 2, torch.float32, device)
    expected_h = ref_lora(y, x, a, b, rows, tiles, [32, 16])[1]
    h = torch.full((1, 16), float("nan"), device=device)
    with side_lane():
        triton_lora_shrink(x, a, rows, tiles, out=h)
        side_counters = semaphore_counters(h.device, 1)
    assert_matches(h, expected_h)
    assert side_counters is not semaphore_counters(h.device, 1)
    assert not side_counters.any()
