"""The MoE routing ops as Triton kernels: ``router_topk``, and ``router_topk_count`` (the router and its
layer's load counter), one launch each.

Their torch versions (``moe.py``) are chains of small kernels: softmax, topk, sum, divide, casts and
copies for the router (about seven launches a sparse layer), compare, cast, expand and index-add for
the counter. At decode every one of them is a launch of a few microseconds on a few hundred bytes,
so a layer's routing took longer than reading its experts' weights. Here it is one launch with
programmatic dependent launch.

One program per row holds the row's logits (every expert), takes the softmax in f32 as the reference
does, then picks the top-k by k rounds of max (the lowest index among equal probabilities), largest
first, and renormalizes the picked weights when asked. ``router_topk_count`` then adds the row's
choices (distinct experts) to the counters with integer atomics, exact in any order, unless the row
is padding (slot -1). ``count_experts`` alone has no Triton kernel: the pipeline always fuses it
into its router (``passes/fuse_router_count.py``), and the torch one serves a graph that skips that pass.
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
def _router_topk_kernel(logits_ptr, weights_ptr, ids_ptr, counts_ptr, slots_ptr, experts, logits_st,
                        TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, COUNT: tl.constexpr, E_POW2: tl.constexpr,
                        K_POW2: tl.constexpr, PDL: tl.constexpr):
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
    if COUNT:  # router_topk_count: the row's choices (distinct experts) added to the counters
        real = tl.load(slots_ptr + row) >= 0
        tl.atomic_add(counts_ptr + ids, tl.full([K_POW2], 1, tl.int64), mask=(slot < TOP_K) & real, sem="relaxed")


def triton_router_topk(logits: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor], top_k: int,
                       renormalize: bool = False, scoring: str = "softmax", config: KernelConfig = DEFAULTS) -> None:
    _launch_router("triton.router_topk", logits, out, top_k, renormalize, scoring, config)


def triton_router_topk_count(logits: torch.Tensor, counts: torch.Tensor, slots: torch.Tensor, *,
                             out: tuple[torch.Tensor, torch.Tensor], top_k: int, renormalize: bool = False,
                             scoring: str = "softmax", config: KernelConfig = DEFAULTS) -> torch.Tensor:
    """``triton_router_topk``, also adding each real row's choices to ``counts`` in place (returned:
    the op aliases it)."""
    require(counts.dtype == torch.int64 and counts.is_contiguous() and slots.is_contiguous(),
            "triton.router_topk_count", lambda: f"counts must be a contiguous int64 and slots contiguous, got {counts.dtype}")
    _launch_router("triton.router_topk_count", logits, out, top_k, renormalize, scoring, config, (counts, slots))
    return counts


def _launch_router(kernel: str, logits: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor], top_k: int,
                   renormalize: bool, scoring: str, config: KernelConfig,
                   counting: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """One program a row; ``counting``: the (counts, slots) the row's choices are added to."""
    weights, ids = out
    require_float(kernel, "logits", logits)
    require(scoring == "softmax", kernel, lambda: f"scoring {scoring!r} is not supported; supported: softmax")
    require(logits.dim() == 2 and logits.stride(1) == 1, kernel,
            lambda: f"logits must be a row-major [T, E], got shape {tuple(logits.shape)} strides {logits.stride()}")
    require(weights.is_contiguous() and ids.is_contiguous() and ids.dtype == torch.int32, kernel,
            lambda: f"outputs must be contiguous, ids int32; got {ids.dtype}")
    counts, slots = counting if counting is not None else (ids, ids)  # unread without counting
    require_device(kernel, logits, weights, ids, counts, slots)
    rows, experts = logits.shape
    if rows == 0:
        return
    # The k rounds of max are the kernel's whole critical path: in one warp each is a few shuffles,
    # with no trip through shared memory and no barrier (up to 512 experts, 16 a thread).
    _router_topk_kernel[(rows,)](logits, weights, ids, counts, slots, experts, logits.stride(0), TOP_K=top_k,
                                 RENORMALIZE=renormalize, COUNT=counting is not None, E_POW2=pow2(experts),
                                 K_POW2=pow2(top_k), num_warps=1 if experts <= 512 else 4,
                                 **pdl_launch(logits, config.pdl))


def _router_checker(types: Sequence[TensorType], attrs: Mapping[str, Any]) -> bool:
    return types[0].dtype in IR_FLOATS and attrs.get("scoring", "softmax") == "softmax"


register_impl("router_topk", "triton", triton_router_topk, checker=_router_checker, priority=10, wants_config=True)
register_impl("router_topk_count", "triton", triton_router_topk_count, checker=_router_checker, priority=10,
              wants_config=True)
