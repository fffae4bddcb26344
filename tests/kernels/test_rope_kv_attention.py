"""rope_kv_attention against its reference (ref_rope_kv_store, then ref_paged_attention): the decode
kernel rotating and storing the new tokens itself, at several split counts, GQA groups, partial
rotary widths and windows, and the extend path's composition; the pool must hold the same k and v."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels import KernelConfig, triton_support
from kiln.kernels.attention_decode import NewTokens, launch_decode, preloads_first_block
from kiln.kernels.registry import get_impl
from kiln.kernels.rope_kv_attention import ref_rope_kv_attention, triton_rope_kv_attention

from .test_attention import Batch, attrs, check_rows, make_batch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def new_tokens(batch: Batch, rot: int, page_size: int, max_pos: int | None = None) -> NewTokens:
    """Unrotated k and v for every row (views of a wider qkv-like tensor, as in a real step), each
    sequence's query at its context's last position and slot; rows of no sequence get slot -1. The
    cos/sin table covers ``max_pos`` positions (default: the longest context)."""
    tokens, _, head_dim = batch.q.shape
    kv_heads = batch.k_cache.shape[1]
    kv = torch.randn(tokens, 2 * kv_heads + 1, head_dim, device=batch.q.device).to(batch.q.dtype)
    positions = torch.zeros(tokens, dtype=torch.int32)
    slots = torch.full((tokens,), -1, dtype=torch.int32)
    for b, (start, n, length) in enumerate(zip(batch.q_start.tolist(), batch.q_len.tolist(), batch.kv_len.tolist())):
        for i in range(n):
            pos = length - n + i
            positions[start + i] = pos
            slots[start + i] = int(batch.page_table[b, pos // page_size]) * page_size + pos % page_size
    angles = torch.rand(max_pos or int(batch.kv_len.max()), rot // 2) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1).to(batch.q.device)
    return NewTokens(kv[:, :kv_heads], kv[:, kv_heads:2 * kv_heads], positions.to(batch.q.device), cos_sin,
                     slots.to(batch.q.device))


@pytest.fixture(params=[False, True], ids=["loaded_after_wait", "preloaded"])
def first_block(request) -> KernelConfig:
    """A config (16-key blocks) with every decode program loading its first key block after the PDL
    wait, and one with every program loading it before (whatever the grid's size)."""
    return KernelConfig(decode_block_n=16, decode_preload_max_programs_per_sm=10**6 if request.param else 0)


def reference(batch: Batch, new: NewTokens, **kw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return ref_rope_kv_attention(batch.q, new.k, new.v, new.positions, new.cos_sin, batch.k_cache.clone(),
                                 batch.v_cache.clone(), new.slots, batch.q_start, batch.q_len, batch.kv_len,
                                 batch.page_table, **kw)


def check(batch: Batch, new: NewTokens, out: torch.Tensor, want, assert_matches) -> None:
    """The output rows and the whole pool (new entries and untouched ones) match the reference."""
    want_out, want_k, want_v = want
    check_rows(out, batch, want_out, assert_matches)
    assert_matches(batch.k_cache, want_k)
    assert_matches(batch.v_cache, want_v)
    # v is copied, never computed: exact.
    assert torch.equal(batch.v_cache, want_v)


# (q_lens, kv_lens, heads, kv_heads, head_dim, rot, page_size, sliding_window, soft_cap, splits)
DECODE_CASES = [
    ([1, 0, 1, 1], [9, 4, 40, 33], 8, 2, 64, 64, 4, 0, 0.0, 3),
    ([1, 1, 1], [1, 17, 64], 3, 3, 64, 32, 1, 0, 0.0, 1),      # partial rotary: dims 32.. pass through
    ([1, 1], [9, 70], 12, 4, 128, 128, 16, 0, 0.0, 8),        # empty splits; the last token in split 0
    ([1, 1, 0, 1], [50, 12, 3, 33], 9, 3, 64, 64, 4, 10, 3.0, 2),
    ([1, 1], [5, 80], 4, 1, 96, 64, 16, 100, 0.0, 4),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_rotates_and_stores(case, dtype, device, poisoned, assert_matches, first_block):
    q_lens, kv_lens, heads, kv_heads, head_dim, rot, page_size, window, cap, splits = case
    batch = make_batch(q_lens, kv_lens, heads, kv_heads, head_dim, page_size, dtype, device, gap=1)
    new = new_tokens(batch, rot, page_size)
    kw = attrs(head_dim, page_size, window, cap)
    want = reference(batch, new, **kw)
    out = poisoned(tuple(batch.q.shape), dtype)
    launch_decode(*batch.inputs(), out, num_splits=splits, new_tokens=new, config=first_block, **kw)
    check(batch, new, out, want, assert_matches)
    assert all(not c.any() for c in triton_support._counters.values())


def test_padding_rows_store_nothing(device, poisoned, assert_matches, first_block):
    # A decode graph pads its batch with rows of one query over one token of context on the reserved
    # page 0 and slot -1: they attend, and store nothing (a store at slot -1 would write out of bounds).
    batch = make_batch([1, 1, 1], [20, 1, 1], 6, 2, 64, 4, torch.bfloat16, device)
    batch.page_table[1:] = 0
    new = new_tokens(batch, 64, 4)
    new.slots[1:] = -1
    want = reference(batch, new, **attrs(64, 4))
    before = batch.k_cache.clone()
    out = poisoned(tuple(batch.q.shape), torch.bfloat16)
    launch_decode(*batch.inputs(), out, num_splits=2, new_tokens=new, config=first_block, **attrs(64, 4))
    check(batch, new, out, want, assert_matches)
    changed = (batch.k_cache != before).any(dim=(1, 2)).nonzero().flatten().tolist()
    assert changed == [int(new.slots[0])]


def test_preloads_only_a_grid_resident_at_once():
    assert preloads_first_block(264, sm_count=132)
    assert not preloads_first_block(265, sm_count=132)
    assert not preloads_first_block(1, sm_count=132, config=KernelConfig(decode_preload_max_programs_per_sm=0))


@pytest.mark.parametrize("sizes", [
    {"T": 3, "B": 3, "max_q_len": 1, "max_kv_len": 300},   # decode: the fused decode kernel
    {"T": 3, "B": 3, "max_kv_len": 300},                    # max_q_len unknown: rope, store, then extend
])
def test_dispatch(sizes, device, poisoned, assert_matches):
    batch = make_batch([1, 1, 1], [300, 7, 129], 8, 2, 64, 16, torch.bfloat16, device)
    new = new_tokens(batch, 64, 16)
    want = reference(batch, new, **attrs(64, 16))
    out = poisoned(tuple(batch.q.shape), torch.bfloat16)
    triton_rope_kv_attention(batch.q, new.k, new.v, new.positions, new.cos_sin, batch.k_cache, batch.v_cache,
                             new.slots, batch.q_start, batch.q_len, batch.kv_len, batch.page_table, out=out,
                             sizes=sizes, **attrs(64, 16))
    check(batch, new, out, want, assert_matches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_and_extend(dtype, device, poisoned, assert_matches):
    # Prompts from scratch, a cached prefix extended, and a decode row, in one step.
    batch = make_batch([5, 20, 1], [5, 40, 33], 6, 2, 64, 4, dtype, device)
    new = new_tokens(batch, 64, 4)
    want = reference(batch, new, **attrs(64, 4))
    out = poisoned(tuple(batch.q.shape), dtype)
    triton_rope_kv_attention(batch.q, new.k, new.v, new.positions, new.cos_sin, batch.k_cache, batch.v_cache,
                             new.slots, batch.q_start, batch.q_len, batch.kv_len, batch.page_table, out=out,
                             sizes={"T": 26, "B": 3, "max_q_len": 20, "max_kv_len": 40}, **attrs(64, 4))
    check(batch, new, out, want, assert_matches)


def test_rejects_bad_inputs(device):
    batch = make_batch([1], [4], 4, 2, 64, 4, torch.float32, device)
    new = new_tokens(batch, 64, 4)
    call = lambda **change: triton_rope_kv_attention(  # noqa: E731
        batch.q, change.get("k", new.k), new.v, new.positions, change.get("cos_sin", new.cos_sin), batch.k_cache,
        batch.v_cache, new.slots, batch.q_start, batch.q_len, batch.kv_len, batch.page_table,
        out=torch.empty_like(batch.q), sizes={"max_q_len": 1}, **attrs(64, 4))
    with pytest.raises(ValueError, match="k \\(1, 3, 64\\)"):
        call(k=torch.randn(1, 3, 64, device=device))
    with pytest.raises(ValueError, match="rotary width 66"):
        call(cos_sin=torch.randn(8, 66, device=device))


def test_registration():
    assert get_impl("triton.rope_kv_attention").wants_sizes
    assert get_impl("torch.rope_kv_attention").op == "rope_kv_attention"


@pytest.mark.gpu
def test_decode_replays_in_a_cuda_graph(device):
    # SmolLM2's attention shape, captured once and replayed as the context grows: each replay stores
    # the step's k and v where the reference does (bit for bit: the GPU rounds as torch does) and
    # attends over them.
    heads, kv_heads, head_dim, page = 9, 3, 64, 16
    batch = make_batch([1] * 4, [1] * 4, heads, kv_heads, head_dim, page, torch.bfloat16, device)
    batch.page_table = torch.arange(1, 4 * 32 + 1, device=device, dtype=torch.int32).view(4, 32)
    batch.k_cache = torch.randn((4 * 32 + 1) * page, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    batch.v_cache = torch.randn_like(batch.k_cache)
    new = new_tokens(batch, head_dim, page, max_pos=32 * page)
    out = torch.empty_like(batch.q)
    sizes = {"T": 4, "B": 4, "max_q_len": 1, "max_kv_len": 32 * page}

    def run() -> None:
        triton_rope_kv_attention(batch.q, new.k, new.v, new.positions, new.cos_sin, batch.k_cache, batch.v_cache,
                                 new.slots, batch.q_start, batch.q_len, batch.kv_len, batch.page_table, out=out,
                                 sizes=sizes, **attrs(head_dim, page))

    run()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(20):
        batch.kv_len.copy_(torch.randint(1, 32 * page - 2, (4,), dtype=torch.int32))
        fresh = new_tokens(batch, head_dim, page)
        new.k.copy_(fresh.k)
        new.v.copy_(fresh.v)
        new.positions.copy_(fresh.positions)
        new.slots.copy_(fresh.slots)
        want_out, want_k, want_v = reference(batch, new, **attrs(head_dim, page))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(batch.k_cache, want_k) and torch.equal(batch.v_cache, want_v)
        torch.testing.assert_close(out.float(), want_out.float(), rtol=2e-2, atol=2e-2)
