"""An FP8 (e4m3fn) KV pool in every kernel that writes or reads one: the torch references (stores
k / scale rounded to FP8; attention reads the pool times the scale), and the Triton KV store, extend,
decode and fused rope + store + decode kernels against them, at odd shapes, GQA, windows and scales
other than 1.0 (run under TRITON_INTERPRET=1 on the CPU). Pools are compared by value: the
interpreter casts -0.0 to FP8 +0.0 (a GPU keeps the sign), which reads back the same."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kiln.ir.types import DType, TensorType
from kiln.kernels import KernelConfig, select_impl
from kiln.kernels.attention import ref_paged_attention, triton_paged_attention
from kiln.kernels.attention_decode import launch_decode
from kiln.kernels.attention_extend import launch_extend
from kiln.kernels.kv_store import FP8, from_cache, ref_kv_store, to_cache, triton_kv_store
from kiln.kernels.rope import ref_rope

from .test_attention import DECODE_CASES, EXTEND_CASES, Batch, attrs, check_rows, make_batch
from .test_rope_kv_attention import DECODE_CASES as ROPE_DECODE_CASES
from .test_rope_kv_attention import new_tokens, reference

DTYPES = [torch.float32, torch.bfloat16]
BLOCK_16 = KernelConfig(decode_block_n=16)
# k's scale a power of two, v's not: a kernel that mixes them up, or forgets one, is far off.
SCALES = dict(k_scale=0.25, v_scale=1.7)


def fp8_pool(batch: Batch) -> Batch:
    """``batch`` with its pool stored as an FP8 pool with SCALES stores it."""
    return dataclasses.replace(batch, k_cache=to_cache(batch.k_cache, FP8, SCALES["k_scale"]),
                               v_cache=to_cache(batch.v_cache, FP8, SCALES["v_scale"]))


def test_the_pool_stores_values_over_their_scale_saturated_and_rounded():
    x = torch.tensor([0.0, 1.0, -3.0, 1000.0, -1e6, 0.3])
    stored = to_cache(x, FP8, 2.0)
    assert stored.dtype == FP8
    assert stored.float().tolist() == [0.0, 0.5, -1.5, 448.0, -448.0, 0.15625]  # 0.15 -> nearest e4m3
    assert torch.equal(from_cache(stored, 2.0), stored.float() * 2.0)
    assert torch.equal(to_cache(x, torch.bfloat16, 2.0), x.to(torch.bfloat16))  # a plain pool ignores scales


def test_reference_attention_reads_the_pool_times_its_scale(device):
    batch = fp8_pool(make_batch([3, 1], [9, 20], 4, 2, 64, 4, torch.float32, device))
    dequantized = dataclasses.replace(batch, k_cache=from_cache(batch.k_cache, SCALES["k_scale"]),
                                      v_cache=from_cache(batch.v_cache, SCALES["v_scale"]))
    assert torch.equal(ref_paged_attention(*batch.inputs(), **attrs(64, 4), **SCALES),
                       ref_paged_attention(*dequantized.inputs(), **attrs(64, 4)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,kv_heads,head_dim,slots_count", [(1, 1, 64, 8), (7, 3, 64, 40), (4, 2, 72, 16)])
def test_triton_store_rounds_as_the_reference(tokens, kv_heads, head_dim, slots_count, dtype, device):
    qkv = (torch.randn(tokens, 4 + 2 * kv_heads, head_dim, device=device) * 200).to(dtype)  # some saturate
    k, v = qkv[:, 4:4 + kv_heads], qkv[:, 4 + kv_heads:]
    slots = torch.randperm(slots_count, device=device)[:tokens].to(torch.int32)
    slots[::3] = -1
    k_cache = to_cache(torch.randn(slots_count, kv_heads, head_dim, device=device), FP8, 1.0)
    v_cache = to_cache(torch.randn_like(k_cache, dtype=torch.float32), FP8, 1.0)
    want_k, want_v = ref_kv_store(k_cache.clone(), v_cache.clone(), k, v, slots, **SCALES)
    triton_kv_store(k_cache, v_cache, k, v, slots, **SCALES)
    assert torch.equal(k_cache.float(), want_k.float()) and torch.equal(v_cache.float(), want_v.float())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", EXTEND_CASES)
def test_extend_kernel_reads_fp8(case, dtype, device, poisoned, assert_matches):
    q_lens, kv_lens, heads, kv_heads, head_dim, page_size, window, cap = case
    batch = fp8_pool(make_batch(q_lens, kv_lens, heads, kv_heads, head_dim, page_size, dtype, device, gap=1))
    out = poisoned(tuple(batch.q.shape), dtype)
    kw = dict(attrs(head_dim, page_size, window, cap), **SCALES)
    launch_extend(*batch.inputs(), out, max_q_len=max(q_lens), block_m=16, block_n=16, num_warps=4, **kw)
    check_rows(out, batch, ref_paged_attention(*batch.inputs(), **kw), assert_matches)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_kernel_reads_fp8(case, dtype, device, poisoned, assert_matches):
    q_lens, kv_lens, heads, kv_heads, head_dim, page_size, window, cap, splits = case
    batch = fp8_pool(make_batch(q_lens, kv_lens, heads, kv_heads, head_dim, page_size, dtype, device, gap=1))
    out = poisoned(tuple(batch.q.shape), dtype)
    kw = dict(attrs(head_dim, page_size, window, cap), **SCALES)
    launch_decode(*batch.inputs(), out, num_splits=splits, config=BLOCK_16, **kw)
    check_rows(out, batch, ref_paged_attention(*batch.inputs(), **kw), assert_matches)


def check_fused(batch: Batch, new, out: torch.Tensor, want, kw: dict, assert_matches) -> None:
    """The pool the kernel wrote is the reference's (v, stored as it comes: exactly; k within one FP8
    step, plus for bf16 the rotation's error: k is rotated in k's dtype before it is rounded to FP8,
    and the interpreter truncates f32 -> bf16 where a GPU rounds, up to a bf16 ulp of each product of
    |k| < 5, over k_scale 0.25 about 0.2), and the output is the reference attention over that pool:
    what the kernel reads is what it stored."""
    _, want_k, want_v = want
    assert torch.equal(batch.v_cache.float(), want_v.float())
    got_k, want_k = batch.k_cache.float(), want_k.float()
    one_step = torch.exp2(torch.floor(torch.log2(want_k.abs().clamp(min=2.0 ** -6))) - 3)
    rotation = 0.25 if batch.q.dtype == torch.bfloat16 else 0.0
    assert ((got_k - want_k).abs() <= one_step + rotation).all()
    q_rot = ref_rope(batch.q, new.positions, new.cos_sin)
    check_rows(out, batch, ref_paged_attention(q_rot, *batch.inputs()[1:], **kw), assert_matches)


@pytest.mark.parametrize("preload", [False, True], ids=["loaded_after_wait", "preloaded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ROPE_DECODE_CASES[1:3])
def test_fused_decode_rotates_and_stores_fp8(case, dtype, preload, device, poisoned, assert_matches):
    q_lens, kv_lens, heads, kv_heads, head_dim, rot, page_size, window, cap, splits = case
    batch = fp8_pool(make_batch(q_lens, kv_lens, heads, kv_heads, head_dim, page_size, dtype, device, gap=1))
    new = new_tokens(batch, rot, page_size)
    kw = dict(attrs(head_dim, page_size, window, cap), **SCALES)
    want = reference(batch, new, **kw)
    out = poisoned(tuple(batch.q.shape), dtype)
    config = KernelConfig(decode_block_n=16, decode_preload_max_programs_per_sm=10**6 if preload else 0)
    launch_decode(*batch.inputs(), out, num_splits=splits, new_tokens=new, config=config, **kw)
    check_fused(batch, new, out, want, kw, assert_matches)


def test_dispatcher_passes_the_scales_on_the_extend_path(device, poisoned, assert_matches):
    batch = fp8_pool(make_batch([5, 20, 1], [5, 40, 33], 6, 2, 64, 4, torch.bfloat16, device))
    new = new_tokens(batch, 64, 4)
    kw = dict(attrs(64, 4), **SCALES)
    want = reference(batch, new, **kw)
    out = poisoned(tuple(batch.q.shape), torch.bfloat16)
    triton_paged_attention(*batch.inputs(), out=out, sizes={"max_q_len": 20}, new_tokens=new, **kw)
    check_fused(batch, new, out, want, kw, assert_matches)


def test_registry_picks_triton_for_an_fp8_pool():
    cache = TensorType(("NS", 2, 64), DType.f8e4m3)
    q, k = TensorType(("T", 8, 64), DType.bf16), TensorType(("T", 2, 64), DType.bf16)
    index = TensorType(("B",), DType.i32)
    table = TensorType(("B", "P"), DType.i32)
    slots, positions = TensorType(("T",), DType.i32), TensorType(("T",), DType.i32)
    cos_sin = TensorType((64, 64), DType.f32)
    assert select_impl("kv_store", [cache, cache, k, k, slots], SCALES, "triton").name == "triton.kv_store"
    assert select_impl("paged_attention", [q, cache, cache, index, index, index, table], {}, "triton").name == \
        "triton.paged_attention"
    assert select_impl("rope_kv_attention", [q, k, k, positions, cos_sin, cache, cache, slots, index, index, index,
                                             table], {}, "triton").name == "triton.rope_kv_attention"
