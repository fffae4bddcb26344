"""Triton paged attention (decode and extend kernels, and the dispatcher) against the torch reference."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kiln.ir.types import DType, TensorType
from kiln.kernels import KernelConfig, attention, select_impl, triton_support
from kiln.kernels.attention import ref_paged_attention, triton_paged_attention
from kiln.kernels.attention_decode import decode_splits, launch_decode
from kiln.kernels.attention_extend import launch_extend

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Decode kernels step through keys 16 at a time, so small test contexts still span several blocks.
BLOCK_16 = KernelConfig(decode_block_n=16)


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    q_start: torch.Tensor
    q_len: torch.Tensor
    kv_len: torch.Tensor
    page_table: torch.Tensor
    owned: torch.Tensor  # [T] bool: rows that belong to some sequence

    def inputs(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k_cache, self.v_cache, self.q_start, self.q_len, self.kv_len, self.page_table


def make_batch(q_lens: list[int], kv_lens: list[int], heads: int, kv_heads: int, head_dim: int, page_size: int,
               dtype: torch.dtype, device: str, gap: int = 0, index_dtype: torch.dtype = torch.int32) -> Batch:
    """Sequences with scattered pages (page 0 unused, as in the runtime's pool), a page table one
    column wider than needed (padding entries 0), and ``gap`` rows owned by no sequence after each
    sequence's rows. q is a view into a wider qkv-like tensor, as in a real step."""
    pages = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(pages) + 1
    order = (torch.randperm(num_pages - 1) + 1).tolist()
    table = torch.zeros(len(q_lens), max(pages) + 1, dtype=index_dtype)
    for b, count in enumerate(pages):
        table[b, :count] = torch.tensor(order[:count], dtype=index_dtype)
        order = order[count:]
    starts, row = [], 0
    for n in q_lens:
        starts.append(row)
        row += n + gap
    tokens = row
    owned = torch.zeros(tokens, dtype=torch.bool)
    for s, n in zip(starts, q_lens):
        owned[s:s + n] = True
    slots = num_pages * page_size
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, device=device).to(dtype)
    k_cache = torch.randn(slots, kv_heads, head_dim, device=device).to(dtype)
    return Batch(qkv[:, :heads], k_cache, torch.randn_like(k_cache),
                 torch.tensor(starts, dtype=index_dtype, device=device),
                 torch.tensor(q_lens, dtype=index_dtype, device=device),
                 torch.tensor(kv_lens, dtype=index_dtype, device=device), table.to(device), owned.to(device))


def check_rows(out: torch.Tensor, batch: Batch, want: torch.Tensor, assert_matches) -> None:
    """Owned rows match the reference (and were all written); rows of no sequence are untouched."""
    assert_matches(out[batch.owned], want[batch.owned])
    assert torch.isnan(out[~batch.owned]).all()


def attrs(head_dim: int, page_size: int, window: int = 0, cap: float = 0.0) -> dict:
    return dict(scale=head_dim ** -0.5, page_size=page_size, sliding_window=window, soft_cap=cap)


# (q_lens, kv_lens, heads, kv_heads, head_dim, page_size, sliding_window, soft_cap): prefixes cached
# and new tokens mixed, a q_len 0 sequence, kv_len not a multiple of the 16-key block, GQA 1/3/4.
EXTEND_CASES = [
    ([5, 0, 20, 1], [9, 4, 40, 33], 4, 4, 64, 4, 0, 0.0),
    ([3, 17], [3, 50], 6, 2, 64, 1, 0, 0.0),
    ([2, 33, 7], [30, 33, 7], 8, 2, 128, 16, 0, 0.0),
    ([5, 0, 20, 1], [9, 4, 40, 33], 4, 4, 64, 4, 8, 0.0),
    ([6, 19], [21, 19], 6, 2, 96, 4, 0, 5.0),
    ([2, 33, 7], [30, 33, 7], 8, 2, 64, 16, 5, 3.0),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", EXTEND_CASES)
def test_extend_kernel(case, dtype, device, poisoned, assert_matches):
    q_lens, kv_lens, heads, kv_heads, head_dim, page_size, window, cap = case
    batch = make_batch(q_lens, kv_lens, heads, kv_heads, head_dim, page_size, dtype, device, gap=1)
    out = poisoned(tuple(batch.q.shape), dtype)
    # 16x16 tiles: small enough that every case spans several query and key blocks.
    launch_extend(*batch.inputs(), out, max_q_len=max(q_lens), block_m=16, block_n=16, num_warps=4,
                  **attrs(head_dim, page_size, window, cap))
    check_rows(out, batch, ref_paged_attention(*batch.inputs(), **attrs(head_dim, page_size, window, cap)),
               assert_matches)


# (q_lens, kv_lens, heads, kv_heads, head_dim, page_size, sliding_window, soft_cap, splits)
DECODE_CASES = [
    ([1, 0, 1, 1], [9, 4, 40, 33], 8, 2, 64, 4, 0, 0.0, 3),
    ([1, 1, 1], [1, 17, 64], 3, 3, 64, 1, 0, 0.0, 1),
    ([1, 1], [9, 70], 12, 4, 128, 16, 0, 0.0, 8),   # more splits than key blocks: empty splits
    ([1, 1, 0, 1], [50, 12, 3, 33], 8, 2, 64, 4, 10, 3.0, 2),
    ([1, 1], [5, 80], 4, 1, 64, 16, 100, 0.0, 4),    # window longer than the context
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_kernel(case, dtype, device, poisoned, assert_matches):
    q_lens, kv_lens, heads, kv_heads, head_dim, page_size, window, cap, splits = case
    batch = make_batch(q_lens, kv_lens, heads, kv_heads, head_dim, page_size, dtype, device, gap=1)
    out = poisoned(tuple(batch.q.shape), dtype)
    launch_decode(*batch.inputs(), out, num_splits=splits, config=BLOCK_16, **attrs(head_dim, page_size, window, cap))
    check_rows(out, batch, ref_paged_attention(*batch.inputs(), **attrs(head_dim, page_size, window, cap)),
               assert_matches)


@pytest.fixture
def fresh_counters(monkeypatch) -> dict:
    """An empty semaphore-counter cache for this test, with a tiny minimum size so that it grows."""
    monkeypatch.setattr(triton_support, "_counters", {})
    monkeypatch.setattr(triton_support, "_retired", [])
    monkeypatch.setattr(triton_support, "MIN_COUNTERS", 4)
    return triton_support._counters


def assert_counters_zero() -> None:
    """Every launch must leave every counter buffer (current and outgrown) at zero."""
    for counters in [*triton_support._counters.values(), *triton_support._retired]:
        assert not counters.any(), f"split counters left at {counters.tolist()}"


def run_decode(batch: Batch, splits: int, head_dim: int, page_size: int, poisoned, assert_matches,
               config: KernelConfig = BLOCK_16) -> None:
    out = poisoned(tuple(batch.q.shape), batch.q.dtype)
    launch_decode(*batch.inputs(), out, num_splits=splits, config=config, **attrs(head_dim, page_size))
    check_rows(out, batch, ref_paged_attention(*batch.inputs(), **attrs(head_dim, page_size)), assert_matches)
    assert_counters_zero()


def test_decode_launches_share_counters(fresh_counters, device, poisoned, assert_matches):
    # Launch after launch (as layer after layer, or graph replay after replay) against one counter
    # cache, with batch sizes and split counts changing: each merge happens, each leaves the counters
    # at zero, and the cache grows only when too small, keeping what it outgrew alive.
    launch_decode(*make_batch([1], [20], 4, 2, 64, 4, torch.float32, device).inputs(),
                  torch.empty(1, 4, 64, device=device), num_splits=1, **attrs(64, 4))
    assert not fresh_counters, "one split must not need counters"
    buffers = []
    for size, splits in [(2, 3), (1, 4), (5, 2), (6, 5), (3, 3), (6, 2)]:
        kv_lens = torch.randint(1, 50, (size,)).tolist()
        batch = make_batch([1] * size, kv_lens, 4, 2, 64, 4, torch.float16, device, gap=1)
        run_decode(batch, splits, 64, 4, poisoned, assert_matches)
        buffers.append(fresh_counters[batch.q.device, False])  # (the main lane's: not the side stream's)
        assert buffers[-1].numel() >= size * 2
    assert [b.numel() for b in buffers] == [4, 4, 16, 16, 16, 16]
    assert triton_support._retired == [buffers[0]]


def test_decode_padding_rows_between_split_rows(fresh_counters, device, poisoned, assert_matches):
    # q_len 0 rows (one with no context at all) among real ones: all their splits skip the counter.
    batch = make_batch([0, 1, 0, 1, 1, 0], [7, 45, 0, 1, 30, 60], 6, 2, 64, 4, torch.bfloat16, device, gap=1)
    for splits in (4, 2, 4):
        run_decode(batch, splits, 64, 4, poisoned, assert_matches)


def test_decode_counter_per_sequence_and_group(fresh_counters, device, poisoned):
    # The interpreter runs programs one at a time, so counters shared between groups would still
    # count right there; a counter that never reaches its last ticket shows which outputs it owns.
    batch = make_batch([1, 1], [40, 40], 6, 2, 64, 4, torch.float32, device)
    counters = triton_support.semaphore_counters(batch.q.device, 4)
    counters[1 * 2 + 0] = 1000  # sequence 1, KV group 0: query heads 0-2
    out = poisoned(tuple(batch.q.shape), torch.float32)
    launch_decode(*batch.inputs(), out, num_splits=3, config=BLOCK_16, **attrs(64, 4))
    assert counters.tolist()[:4] == [0, 0, 1003, 0]
    assert torch.isnan(out[1, :3]).all() and not torch.isnan(out[0]).any() and not torch.isnan(out[1, 3:]).any()


def test_decode_empty_splits_take_no_ticket(fresh_counters, device, poisoned):
    # A 20-token context in 16-key blocks over 4 splits fills splits 0 and 1 only: a counter held
    # away from its last ticket ends 2 higher, not 4.
    batch = make_batch([1], [20], 4, 1, 64, 4, torch.float32, device)
    counters = triton_support.semaphore_counters(batch.q.device, 1)
    counters[0] = 1000
    out = poisoned(tuple(batch.q.shape), torch.float32)
    launch_decode(*batch.inputs(), out, num_splits=4, config=BLOCK_16, **attrs(64, 4))
    assert counters.tolist()[:1] == [1002]


def test_decode_merge_in_chunks(fresh_counters, device, poisoned, assert_matches):
    # A merge tile of 2 splits: the merge's running max crosses chunks, the last one partial.
    batch = make_batch([1, 1, 1], [90, 3, 50], 6, 2, 64, 4, torch.float32, device, gap=1)
    config = KernelConfig(decode_block_n=16, decode_merge_tile=2 * 4 * 64)
    run_decode(batch, 5, 64, 4, poisoned, assert_matches, config)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_decode_split_merge(group, head_dim, dtype, fresh_counters, device, poisoned, assert_matches):
    # Six splits of 16-key blocks: contexts of 1 and 3 tokens fill only split 0, 40 tokens only the
    # first three; the empty trailing splits return at once and the merge reads only the others.
    batch = make_batch([1, 1, 1], [3, 40, 1], 2 * group, 2, head_dim, 8, dtype, device, gap=1)
    run_decode(batch, 6, head_dim, 8, poisoned, assert_matches)


@pytest.mark.parametrize("sizes,path", [
    ({"T": 3, "B": 3, "max_q_len": 1, "max_kv_len": 300}, "decode"),
    ({"T": 3, "B": 3, "max_q_len": 1}, "decode"),
    ({"T": 3, "B": 3, "max_kv_len": 300}, "extend"),   # max_q_len unknown: extend handles any lengths
    (None, "extend"),
])
def test_dispatch_of_a_decode_step(sizes, path, device, poisoned, assert_matches, monkeypatch):
    taken = []
    for name in ("launch_decode", "launch_extend"):
        real = getattr(attention, name)
        monkeypatch.setattr(attention, name,
                            lambda *a, _real=real, _name=name, **k: (taken.append(_name), _real(*a, **k)))
    batch = make_batch([1, 1, 1], [300, 7, 129], 8, 2, 64, 16, torch.float32, device)
    out = poisoned(tuple(batch.q.shape), torch.float32)
    triton_paged_attention(*batch.inputs(), out=out, sizes=sizes, **attrs(64, 16))
    assert taken == [f"launch_{path}"]
    check_rows(out, batch, ref_paged_attention(*batch.inputs(), **attrs(64, 16)), assert_matches)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_dispatch_of_a_mixed_step(index_dtype, device, poisoned, assert_matches):
    batch = make_batch([4, 1, 0, 70], [4, 25, 9, 90], 6, 2, 64, 4, torch.bfloat16, device, index_dtype=index_dtype)
    out = poisoned(tuple(batch.q.shape), torch.bfloat16)
    triton_paged_attention(*batch.inputs(), out=out, sizes={"T": 75, "B": 4, "max_q_len": 70, "max_kv_len": 90},
                           **attrs(64, 4, 0, 20.0))
    check_rows(out, batch, ref_paged_attention(*batch.inputs(), **attrs(64, 4, 0, 20.0)), assert_matches)


def test_decode_splits_heuristic():
    # Small batches split long contexts to fill the GPU; large batches or short contexts do not.
    assert decode_splits(batch=1, kv_heads=8, kv_bound=4096, sm_count=132) == 33
    assert decode_splits(batch=8, kv_heads=8, kv_bound=1024, sm_count=132) == 5
    assert decode_splits(batch=64, kv_heads=8, kv_bound=4096, sm_count=132) == 1
    assert decode_splits(batch=1, kv_heads=8, kv_bound=100, sm_count=132) == 2
    assert decode_splits(batch=1, kv_heads=8, kv_bound=64, sm_count=132) == 1
    assert decode_splits(batch=1, kv_heads=1, kv_bound=1 << 20, sm_count=132) == 64


def test_decode_splits_follow_the_kernel_config():
    config = KernelConfig(decode_min_split_tokens=1024, decode_split_programs_per_sm=1, decode_max_splits=8)
    assert decode_splits(batch=1, kv_heads=8, kv_bound=4096, sm_count=132, config=config) == 4
    assert decode_splits(batch=1, kv_heads=1, kv_bound=1 << 20, sm_count=132, config=config) == 8
    assert decode_splits(batch=8, kv_heads=8, kv_bound=4096, sm_count=132, config=config) == 3


def test_rejects_bad_inputs(device):
    batch = make_batch([1, 2], [5, 6], 4, 2, 64, 4, torch.float32, device)
    q, kc, vc, qs, ql, kl, pt = batch.inputs()
    a = attrs(64, 4)

    def call(**change):
        args = dict(q=q, k_cache=kc, v_cache=vc, q_start=qs, q_len=ql, kv_len=kl, page_table=pt)
        args.update(change)
        triton_paged_attention(*args.values(), out=torch.empty_like(args["q"]), **a)

    with pytest.raises(ValueError, match="caches .* must have q's dtype"):
        call(k_cache=kc.half(), v_cache=vc.half())
    with pytest.raises(ValueError, match="q must be \\[T, heads, head_dim\\]"):
        call(q=q[0])
    with pytest.raises(ValueError, match="out .* must match q"):
        triton_paged_attention(q, kc, vc, qs, ql, kl, pt, out=torch.empty(q.shape, device=device).half(), **a)
    with pytest.raises(ValueError, match="cannot share"):
        call(q=torch.randn(q.shape[0], 3, 64, device=device))
    with pytest.raises(ValueError, match="q_len must be int32 or int64"):
        call(q_len=ql.float())
    with pytest.raises(ValueError, match="page_table must have rank 2"):
        call(page_table=pt[0])
    with pytest.raises(ValueError, match="must be alike"):
        call(v_cache=vc[:-1])
    with pytest.raises(ValueError, match="kv_len .* differs from q_start"):
        call(kv_len=kl[:1])
    with pytest.raises(ValueError, match="exceeds the kernels' 256"):
        big = torch.randn(kc.shape[0], 2, 512, device=device)
        call(q=torch.randn(q.shape[0], 4, 512, device=device), k_cache=big, v_cache=big)


def test_registration_and_checker():
    def types(dtype: DType, head_dim: int, cache_dtype: DType | None = None) -> list[TensorType]:
        i32 = DType.i32
        return [TensorType(("T", 32, head_dim), dtype), TensorType(("NS", 8, head_dim), cache_dtype or dtype),
                TensorType(("NS", 8, head_dim), cache_dtype or dtype), TensorType(("B",), i32),
                TensorType(("B",), i32), TensorType(("B",), i32), TensorType(("B", "P"), i32)]

    a = {"scale": 0.088, "page_size": 16, "sliding_window": 0, "soft_cap": 0.0}
    impl = select_impl("paged_attention", types(DType.bf16, 128), a, "triton")
    assert impl.name == "triton.paged_attention" and impl.wants_sizes
    assert select_impl("paged_attention", types(DType.bf16, 512), a, "triton").name == "torch.paged_attention"
    assert select_impl("paged_attention", types(DType.bf16, 128, DType.u8), a,
                       "triton").name == "torch.paged_attention"


# --- realistic shapes on the GPU -------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("batch_size,max_kv", [(64, 4096), (8, 4096), (1, 4096)])
def test_decode_at_scale_on_gpu(batch_size, max_kv, device, poisoned, assert_matches):
    kv_lens = torch.randint(1, max_kv + 1, (batch_size,)).tolist()
    kv_lens[0] = max_kv
    batch = make_batch([1] * batch_size, kv_lens, 32, 8, 128, 16, torch.bfloat16, device)
    out = poisoned(tuple(batch.q.shape), torch.bfloat16)
    sizes = {"T": batch_size, "B": batch_size, "max_q_len": 1, "max_kv_len": max(kv_lens)}
    triton_paged_attention(*batch.inputs(), out=out, sizes=sizes, **attrs(128, 16))
    check_rows(out, batch, ref_paged_attention(*batch.inputs(), **attrs(128, 16)), assert_matches)


@pytest.mark.gpu
@pytest.mark.parametrize("window,cap", [(0, 0.0), (1024, 50.0)])
def test_extend_at_scale_on_gpu(window, cap, device, poisoned, assert_matches):
    q_lens, kv_lens = [2048, 512, 1, 0, 300, 17], [2048, 1500, 700, 50, 300, 4000]
    batch = make_batch(q_lens, kv_lens, 32, 8, 128, 16, torch.bfloat16, device)
    out = poisoned(tuple(batch.q.shape), torch.bfloat16)
    sizes = {"T": sum(q_lens), "B": len(q_lens), "max_q_len": max(q_lens), "max_kv_len": max(kv_lens)}
    triton_paged_attention(*batch.inputs(), out=out, sizes=sizes, **attrs(128, 16, window, cap))
    check_rows(out, batch, ref_paged_attention(*batch.inputs(), **attrs(128, 16, window, cap)), assert_matches)


@pytest.mark.gpu
def test_decode_replays_in_a_cuda_graph(device, assert_matches):
    # Captured once, replayed after the lengths grow: nothing about the lengths is baked in.
    batch = make_batch([1] * 8, [100] * 8, 32, 8, 128, 16, torch.bfloat16, device)
    batch.page_table = torch.arange(1, 8 * 64 + 1, device=device, dtype=torch.int32).view(8, 64)
    pool_slots = (8 * 64 + 1) * 16
    batch.k_cache = torch.randn(pool_slots, 8, 128, device=device, dtype=torch.bfloat16)
    batch.v_cache = torch.randn_like(batch.k_cache)
    out = torch.empty_like(batch.q)
    sizes = {"T": 8, "B": 8, "max_q_len": 1, "max_kv_len": 1024}
    run = lambda: triton_paged_attention(*batch.inputs(), out=out, sizes=sizes, **attrs(128, 16))  # noqa: E731
    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    batch.kv_len.copy_(torch.tensor([1, 5, 64, 100, 333, 512, 1000, 1024], dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(out, ref_paged_attention(*batch.inputs(), **attrs(128, 16)))


@pytest.mark.gpu
@pytest.mark.parametrize("batch_size", [1, 4])
def test_decode_split_counters_across_graph_replays(batch_size, device, assert_matches):
    # SmolLM2-135M's attention (9 heads over 3 KV heads of 64) at 64 and 22 splits, 30 launches per
    # graph as 30 layers, replayed with new lengths each time: a merge that starts before every split
    # has published its partials, or a counter not back at zero for the next launch, shows here.
    layers, width, page = 30, 512, 16
    batch = make_batch([1] * batch_size, [1] * batch_size, 9, 3, 64, page, torch.bfloat16, device)
    batch.page_table = torch.arange(1, batch_size * width + 1, device=device, dtype=torch.int32).view(batch_size, width)
    batch.k_cache = torch.randn((batch_size * width + 1) * page, 3, 64, device=device, dtype=torch.bfloat16)
    batch.v_cache = torch.randn_like(batch.k_cache)
    outs = [torch.empty_like(batch.q) for _ in range(layers)]
    sizes = {"T": batch_size, "B": batch_size, "max_q_len": 1}

    def step() -> None:
        for out in outs:
            triton_paged_attention(*batch.inputs(), out=out, sizes=sizes, **attrs(64, page))

    step()  # compiles, and sizes the counters, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for replay in range(101):
        batch.kv_len.copy_(torch.randint(1, width * page + 1, (batch_size,), dtype=torch.int32))
        for out in outs:
            out.fill_(float("nan"))
        if replay < 100:
            graph.replay()
        else:  # launches outside the graph share its counters
            step()
        want = ref_paged_attention(*batch.inputs(), **attrs(64, page))
        for out in outs:
            assert_matches(out, want)
    assert not triton_support._counters[batch.q.device, False].any()  # (the main lane's)
