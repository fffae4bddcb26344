"""Triton row-wise argmax against torch's: shapes, dtypes, ties within and across chunks, special
values, strided rows, and the semaphore counters it shares with decode attention."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels import KernelConfig, triton_support
from kiln.kernels.argmax import argmax_chunk, ref_argmax_rows, triton_argmax_rows
from kiln.kernels.bitmask import bitmask_width
from kiln.kernels.config import DEFAULTS

ARGMAX_BLOCK = DEFAULTS.argmax_block

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def check(x: torch.Tensor, chunk: int | None = None, config: KernelConfig = DEFAULTS) -> None:
    """The kernel agrees with torch on every row, and leaves the shared counters at zero."""
    got = triton_argmax_rows(x, chunk=chunk, config=config)
    assert got.dtype == torch.int64
    assert got.tolist() == ref_argmax_rows(x).tolist()
    counters = triton_support._counters.get(x.device)
    assert counters is None or not counters.any(), "argmax left semaphore counters non-zero"


# Every (rows, vocab, dtype) but the largest shape in f16 and bf16, which would take the interpreter
# seconds each: f32 covers that shape, and the other dtypes every other one.
SHAPES = [(rows, vocab, dtype) for rows in (1, 3, 64) for vocab in (1, 31, 1000, 49152 + 7) for dtype in DTYPES
          if rows * vocab < 64 * 49152 or dtype == torch.float32]


@pytest.mark.parametrize("rows,vocab,dtype", SHAPES)
def test_matches_torch(rows, vocab, dtype, device):
    # f16 and bf16 round many values alike, so rows often hold their maximum more than once.
    check(torch.randn(rows, vocab, device=device).to(dtype))


@pytest.mark.parametrize("vocab,chunk", [(300, 64), (300, 7), (2 * ARGMAX_BLOCK + 100, None),
                                         (2 * ARGMAX_BLOCK + 100, 3 * ARGMAX_BLOCK)])
def test_ties_take_the_lowest_index(vocab, chunk, device):
    # The maximum twice in a row: in different chunks (10 and 74 in the same lane of two chunks of
    # 64), in one chunk, at the row's ends, and at 5 and vocab - 95 (with a chunk of 3 blocks, one
    # lane of one program in its first and last loop steps).
    pairs = [(250, 10), (10, 74), (30, 20), (vocab - 1, 0), (vocab - 1, vocab - 2), (vocab - 95, 5)]
    x = torch.randn(len(pairs), vocab, device=device)
    for row, (a, b) in enumerate(pairs):
        x[row, a] = x[row, b] = 10.0
    check(x, chunk)


@pytest.mark.parametrize("chunk", [None, 16])
def test_special_values(chunk, device):
    inf, nan = float("inf"), float("nan")
    # NaNs with the sign bit set, and with another payload than torch's default NaN.
    negative_nan = -torch.tensor(nan)
    other_nan = torch.tensor(0x7FC00123, dtype=torch.int32).view(torch.float32)
    rows = torch.randn(10, 300, device=device)
    rows[0] = 3.0                                    # all equal: the first
    rows[1] = -inf                                   # all -inf: the first
    rows[2].masked_fill_(torch.rand(300, device=device) < 0.9, -inf)  # masked logits, as grammars make
    rows[3, 200] = inf                               # +inf wins
    rows[4] = 0.0
    rows[4, :150] = -0.0                             # -0.0 equals 0.0: the first of either
    rows[4, 150:] = -1.0
    rows[5, 250], rows[5, 40] = nan, nan            # the first NaN wins, as in torch
    rows[6, 120], rows[6, 7] = nan, inf
    rows[7] = -1e30
    rows[7, 299] = -1e29                             # large negative values keep their order
    rows[8, 30], rows[8, 90], rows[8, 10] = nan, inf, negative_nan  # any NaN counts, whatever its sign
    rows[9, 70], rows[9, 60] = other_nan, nan        # ... or payload
    check(rows, chunk)
    check(rows.half(), chunk)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows(dtype, device):
    # Rows of a wider tensor, starting at an odd offset: the kernel goes by the row stride.
    wide = torch.randn(5, 1500, device=device).to(dtype)
    x = wide[:, 3:3 + 1001]
    assert x.stride(0) == 1500
    check(x)
    check(x, chunk=100)


def test_merge_in_steps(device):
    # More chunks than the merge takes in one step: its running max crosses steps, the last partial.
    x = torch.randn(2, 100, device=device)
    x[1, 7] = x[1, 99] = 9.0
    check(x, chunk=16, config=KernelConfig(argmax_merge_block=4))


def test_launches_in_a_row(device):
    # Launch after launch with shapes and chunk counts changing, as graph replays of several
    # buckets and decode attention in between: each leaves the counters at zero.
    for rows, vocab, chunk in [(2, 500, 64), (1, 5000, None), (4, 700, 100), (3, 31, 4), (2, 500, 64), (9, 300, 8)]:
        check(torch.randn(rows, vocab, device=device), chunk)


def test_counter_per_row(monkeypatch, device):
    # The interpreter runs programs one at a time, so rows sharing a counter would still count right
    # there; a counter that never reaches its last ticket shows which output it owns.
    monkeypatch.setattr(triton_support, "_counters", {})
    x = torch.randn(3, 100, device=device)
    counters = triton_support.semaphore_counters(x.device, 3)
    counters[1] = 1000
    out = torch.full((3,), -1, dtype=torch.int64, device=device)
    assert triton_argmax_rows(x, out, chunk=25) is out
    assert counters.tolist()[:3] == [0, 1004, 0]
    want = ref_argmax_rows(x)
    assert out.tolist() == [want[0].item(), -1, want[2].item()]


@pytest.mark.parametrize("chunk", [None, 32])
def test_int32_out(device, chunk):
    # A decode graph writes its greedy tokens straight into the next step's int32 input ids.
    x = torch.randn(3, 300, device=device)
    ids = torch.full((5,), -1, dtype=torch.int32, device=device)
    assert triton_argmax_rows(x, ids[1:4], chunk=chunk).data_ptr() == ids[1:4].data_ptr()
    assert ids.tolist() == [-1, *ref_argmax_rows(x).tolist(), -1]


@pytest.mark.parametrize("chunk", [None, 32])
@pytest.mark.parametrize("mirror_dtype", [torch.int32, torch.int64])
def test_mirror_on_the_host(device, chunk, mirror_dtype):
    # A decode graph's argmax also leaves its tokens in pinned host memory for the host to read.
    x = torch.randn(3, 300, device=device)
    mirror = torch.full((3,), -1, dtype=mirror_dtype, pin_memory=x.is_cuda)
    out = triton_argmax_rows(x, torch.empty(3, dtype=torch.int32, device=device), mirror=mirror, chunk=chunk)
    if x.is_cuda:
        torch.cuda.synchronize()
    assert mirror.tolist() == out.tolist() == ref_argmax_rows(x).tolist()


def random_bitmask(rows: int, vocab: int, allowed: float, device) -> torch.Tensor:
    """A packed mask allowing each token with probability ``allowed``."""
    bits = (torch.rand(rows, bitmask_width(vocab) * 32) < allowed).long()
    words = (bits.view(rows, -1, 32) << torch.arange(32)).sum(-1)
    return words.to(torch.int64).where(words < 2 ** 31, words - 2 ** 32).to(torch.int32).to(device)


@pytest.mark.parametrize("rows,vocab,chunk", [(1, 1, None), (3, 33, None), (4, 1000, 64), (2, 2 * ARGMAX_BLOCK + 100, None)])
@pytest.mark.parametrize("allowed", [0.0, 0.02, 0.5, 1.0])
def test_under_a_bitmask(rows, vocab, chunk, allowed, device):
    # Disallowed elements count as -inf: the allowed maximum wins, a row allowing nothing gives 0,
    # and an allowed -inf still beats nothing at a lower index.
    x = torch.randn(rows, vocab, device=device)
    x[0, vocab // 2] = 100.0  # a disallowed maximum must lose
    x[-1, -1] = float("-inf")
    bitmask = random_bitmask(rows, vocab, allowed, device)
    got = triton_argmax_rows(x, bitmask=bitmask, chunk=chunk)
    masked = x.masked_fill(~_allowed(bitmask, vocab), float("-inf"))
    assert got.tolist() == masked.argmax(dim=-1).tolist() == ref_argmax_rows(x, bitmask).tolist()
    assert not triton_support._counters.get(x.device, torch.zeros(1)).any()


def _allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Token t is allowed when bit t % 32 of word t // 32 is set: the layout, bit by bit."""
    ids = torch.arange(vocab, device=bitmask.device)
    return ((bitmask[:, ids // 32] >> (ids % 32)) & 1).bool()


def test_empty_batch(device):
    assert triton_argmax_rows(torch.empty(0, 10, device=device)).shape == (0,)


def test_chunk_heuristic():
    # Batch 1 spreads a row over many SMs, in whole blocks; large batches keep rows whole.
    assert argmax_chunk(rows=1, vocab=49152, sm_count=132) == ARGMAX_BLOCK
    assert argmax_chunk(rows=1, vocab=128256, sm_count=132) == ARGMAX_BLOCK
    assert argmax_chunk(rows=64, vocab=128256, sm_count=132) == 7 * ARGMAX_BLOCK
    assert argmax_chunk(rows=1024, vocab=128256, sm_count=132) >= 128256
    assert argmax_chunk(rows=1, vocab=31, sm_count=132) == ARGMAX_BLOCK
    # The kernel config's block and target: one program an SM at batch 1 makes chunks of 1024 * 2.
    config = KernelConfig(argmax_block=1024, argmax_programs_per_sm=1)
    assert argmax_chunk(rows=1, vocab=128256, sm_count=66, config=config) == 2 * 1024


def test_rejects_bad_inputs(device):
    x = torch.randn(2, 10, device=device)
    with pytest.raises(ValueError, match="must be \\[R, V\\]"):
        triton_argmax_rows(x[0])
    with pytest.raises(ValueError, match="V > 0"):
        triton_argmax_rows(x[:, :0])
    with pytest.raises(ValueError, match="must be f32, f16 or bf16"):
        triton_argmax_rows(x.int())
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        triton_argmax_rows(x.t())
    with pytest.raises(ValueError, match="out must be contiguous int64 or int32"):
        triton_argmax_rows(x, torch.empty(2, dtype=torch.int16, device=device))
    with pytest.raises(ValueError, match="out must be contiguous int64 or int32 \\[2\\]"):
        triton_argmax_rows(x, torch.empty(3, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="mirror must be contiguous int64 or int32 \\[2\\] in pinned host"):
        triton_argmax_rows(x, mirror=torch.empty(3, dtype=torch.int32))
    if x.is_cuda:
        with pytest.raises(ValueError, match="not pinned"):
            triton_argmax_rows(x, mirror=torch.empty(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="bitmask must be int32 \\[2, 1\\]"):
        triton_argmax_rows(x, bitmask=torch.zeros(2, 2, dtype=torch.int32, device=device))


# --- the GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("rows,vocab", [(1, 49152), (1, 128256), (8, 49152), (64, 128256), (256, 151936)])
@pytest.mark.parametrize("masked", [False, True])
def test_replays_in_a_cuda_graph(rows, vocab, masked, device):
    # Captured once (as the decode graph captures it: int32 ids and a pinned host mirror), replayed
    # with new logits each time: random normals, and small integers, whose maximum sits in many chunks
    # at once. A merge that starts before every chunk has published its partial, or a counter not back
    # at zero, shows here.
    x = torch.empty(rows, vocab, device=device)
    x.normal_()
    bitmask = random_bitmask(rows, vocab, 0.3, device) if masked else None
    ids = torch.empty(rows, dtype=torch.int32, device=device)
    mirror = torch.empty(rows, dtype=torch.int32, pin_memory=True)
    triton_argmax_rows(x, ids, bitmask=bitmask, mirror=mirror)  # compiles, sizes the counters, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_argmax_rows(x, ids, bitmask=bitmask, mirror=mirror)
    for replay in range(100):
        if replay % 2:
            x.copy_(torch.randint(-1000, 8, (rows, vocab), device=device))
        else:
            x.normal_()
        graph.replay()
        torch.cuda.synchronize()
        want = ref_argmax_rows(x, bitmask)
        assert torch.equal(out.long(), want) and torch.equal(mirror.long(), want.cpu()), f"replay {replay}"
    assert not triton_support._counters[x.device, False].any()  # (the main lane's)
