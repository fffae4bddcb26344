"""The MoE routing ops as Triton kernels: ``router_topk`` and ``count_experts``, one launch each.

Their torch versions (``moe.py``) are chains of small kernels: softmax, topk, sum, divide, casts and
copies for the router (about seven launches a sparse layer), compare, cast, expand and index-add for
the counter. At decode every one of them is a launch of a few microseconds on a few hundred bytes,
so a layer's routing took longer than reading its experts' weights. Here each is one launch with
programmatic dependent launch.

- ``router_topk``: one program per row holds the row's logits (every expert), takes the softmax in
  f32 as the reference does, then picks the top-k by k rounds of max (the lowest index among equal
  probabilities), largest first, and renormalizes the picked weights when asked.
- ``count_experts``: each program counts a chunk of the (row, choice) pairs against every expert and
  adds its counts to the state with integer atomics (exact, so the order does not matter).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import triton
import triton.language as tl

from kiln.ir.types import TensorType

from .config import DEFAULTS, KernelConfig
from .registry import register_impl
from .triton_support import IR_FLOATS, await_previous_kernel, pdl_launch, pow2, require, require_device, require_float


@triton.jit
def _router_topk_kernel(logits_ptr, weights_ptr, ids_ptr, experts, logits_st, TOP_K: tl.constexpr,
                        RENORMALIZE: tl.constexpr, E_POW2: tl.constexpr, K_POW2: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_POW2)
    await_previous_kernel(PDL)
    logits = tl.load(logits_ptr + row * logits_st + e, mask=e < experts, other=-float("inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, axis=0))
    # Padding experts get -1: below every probability, so never picked.
    p = tl.where(e < experts, p / tl.sum(p, axis=0), -1.0)
    slot = tl.arange(0, K_POW2)
    weights = tl.zeros([K_POW2], tl.float32)
    ids = tl.zeros([K_POW2], tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        pick = tl.min(tl.where(p == best, e, E_POW2), axis=0)
        weights = tl.where(slot == j, best, weights)
        ids = tl.where(slot == j, pick, ids)
        p = tl.where(e == pick, -1.0, p)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)  # slots past TOP_K hold 0
    tl.store(weights_ptr + row * TOP_K + slot, weights, mask=slot < TOP_K)
    tl.store(ids_ptr + row * TOP_K + slot, ids, mask=slot < TOP_K)


@triton.jit
def _count_experts_kernel(counts_ptr, ids_ptr, slots_ptr, experts, pairs, top_k, E_POW2: tl.constexpr,
                          CHUNK: tl.constexpr, PDL: tl.constexpr):
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    e = tl.arange(0, E_POW2)
    await_previous_kernel(PDL)
    slot = tl.load(slots_ptr + offs // top_k, mask=offs < pairs, other=-1)
    ids = tl.load(ids_ptr + offs, mask=slot >= 0, other=-1)
    counts = tl.sum((ids[:, None] == e[None, :]).to(tl.int32), axis=0).to(tl.int64)
    tl.atomic_add(counts_ptr + e, counts, mask=(e < experts) & (counts > 0), sem="relaxed")


def triton_router_topk(logits: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor], top_k: int,
                       renormalize: bool = False, scoring: str = "softmax", config: KernelConfig = DEFAULTS) -> None:
    kernel = "triton.router_topk"
    weights, ids = out
    require_float(kernel, "logits", logits)
    require(scoring == "softmax", kernel, lambda: f"scoring {scoring!r} is not supported; supported: softmax")
    require(logits.dim() == 2 and logits.stride(1) == 1, kernel,
            lambda: f"logits must be a row-major [T, E], got shape {tuple(logits.shape)} strides {logits.stride()}")
    require(weights.is_contiguous() and ids.is_contiguous() and ids.dtype == torch.int32, kernel,
            lambda: f"outputs must be contiguous, ids int32; got {ids.dtype}")
    require_device(kernel, logits, weights, ids)
    rows, experts = logits.shape
    if rows == 0:
        return
    # The k rounds of max are the kernel's whole critical path: in one warp each is a few shuffles,
    # with no trip through shared memory and no barrier (up to 512 experts, 16 a thread).
    _router_topk_kernel[(rows,)](logits, weights, ids, experts, logits.stride(0), TOP_K=top_k,
                                 RENORMALIZE=renormalize, E_POW2=pow2(experts), K_POW2=pow2(top_k),
                                 num_warps=1 if experts <= 512 else 4, **pdl_launch(logits, config.pdl))


def triton_count_experts(counts: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor, *,
                         config: KernelConfig = DEFAULTS, chunk: int = 64) -> torch.Tensor:
    """Adds the step's choices per expert to ``counts`` in place and returns it (the op aliases it)."""
    kernel = "triton.count_experts"
    require(counts.dtype == torch.int64 and counts.is_contiguous(), kernel,
            lambda: f"counts must be a contiguous int64, got {counts.dtype}")
    require(ids.is_contiguous() and slots.is_contiguous(), kernel, lambda: "ids and slots must be contiguous")
    require_device(kernel, counts, ids, slots)
    pairs = ids.numel()
    if pairs:
        _count_experts_kernel[(triton.cdiv(pairs, chunk),)](
            counts, ids, slots, counts.numel(), pairs, ids.shape[1], E_POW2=pow2(counts.numel()), CHUNK=chunk,
            num_warps=4, **pdl_launch(counts, config.pdl))
    return counts


def _router_checker(types: Sequence[TensorType], attrs: Mapping[str, Any]) -> bool:
    return types[0].dtype in IR_FLOATS and attrs.get("scoring", "softmax") == "softmax"


register_impl("router_topk", "triton", triton_router_topk, checker=_router_checker, priority=10, wants_config=True)
register_impl("count_experts", "triton", triton_count_experts, priority=10, wants_config=True)
