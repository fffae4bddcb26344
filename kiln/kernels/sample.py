"""The sampled rows of a decode step: temperature, top-k, top-p and min-p, then the Gumbel-max draw.

``ref_sample_rows`` is what ``sampler.sample`` does for non-greedy rows once penalties, bias and
grammar are applied: scores divided by temperature; top-k and top-p on the distribution sorted from
the most likely token down (stable, so equal scores keep id order); min-p; then the token is
``argmax(scores + gumbel)`` with float64 noise from ``rng`` keyed by (seed, step, vocab id).
The full-vocabulary sort makes it ~0.8 ms a step on a GPU.

``triton_sample_rows`` gets the same tokens without sorting, one program per row looping over it:

1. one pass: the row's largest scaled score ``m`` and its smallest and largest order keys (the int32
   key of an f32 is its bits with the magnitude negated for negative values: integer order is float
   order, -0.0 and 0.0 are one key).
2. top-k: bisection over keys for ``cut_k``, the largest key with at least k scores at or above it.
   Each step counts the scores at or above the midpoint in one pass over the row (it sits in L2) and
   moves the bound to the nearest key present, stopping early when exactly k are above (12-18
   passes on normally distributed rows of 49k-128k scores). Scores above ``cut_k`` are kept, and of
   those at ``cut_k`` the first ``k - count above`` by id, as the stable sort keeps them.
3. one pass: the mass ``sum(exp(s - m))`` above ``cut_k`` and the score at it, so that
   ``Z = mass above + kept ties * exp(score at cut - m)`` normalizes over the top-k survivors.
4. top-p: the reference keeps a token when the probability of the tokens strictly before it in the
   sorted order is below p. Bisection over keys (at or above ``cut_k``) for ``cut_p``, the smallest
   key whose mass strictly above, over Z, is below p (4-20 passes); scores above it are kept, and a
   score at it is kept while ``mass above / Z + (its rank among the ties) * its probability < p``.
5. the draw: min-p keeps scores at or above ``m + log(min_p)`` (``m`` is the top-1 score, never
   filtered, so it is also the filtered row's max); the noise is ``rng``'s, in uint64 and float64
   operation for operation; the token is the lowest id of the largest ``score + noise`` over the kept.

Exactness: scaling uses IEEE division as torch does (Triton's ``/`` is approximate on NVIDIA), keys
and counts are exact, so top-k keeps exactly the reference's tokens, and the noise's bits are
``rng``'s (its float64 ``log`` is libdevice's on the GPU, as torch's CUDA ``log``; numpy's under the
interpreter, which may differ from torch's CPU one by an ulp: that only matters for draws tied to
~1e-16). Top-p sums probabilities in another order than torch's cumsum (whose CPU and CUDA orders
differ too), and ``exp`` and min-p's ``log`` may differ from torch's by an ulp, so a top-p or min-p
cut that lands within float rounding of the boundary may keep or drop one token more. The draw
differs only if it lands that close and that token also wins the draw: for random inputs about the
running sum's rounding error, 1e-6 to 1e-5 a row.

Cost: each bisection step reads the row again (from L2), ~20-40 reads of the row with top-k and top-p
both on, plus two float64 logs per score in the draw; no host synchronization, so the launch can be
captured in a CUDA graph. Not yet measured on a GPU.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import rng

from .triton_support import await_previous_kernel, pdl_launch, require, require_device, require_unit_last_stride

# Elements per loop step. Not yet tuned on a GPU.
SAMPLE_BLOCK = 2048

_GOLDEN = tl.constexpr(rng.GOLDEN)
_M1 = tl.constexpr(rng.M1)
_M2 = tl.constexpr(rng.M2)
# The key of ids past the row's end: below -inf's key (-0x7F800000), so no count or cut includes them.
_NO_KEY = tl.constexpr(-(2 ** 31))
_MAX_KEY = tl.constexpr(2 ** 31 - 1)


def ref_filter_top_k_top_p(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                           use_top_k: bool, use_top_p: bool) -> torch.Tensor:
    """Set to -inf what top-k and top-p exclude. Both work on the distribution sorted from the most
    likely token down (stable, so equal scores keep id order): top-k keeps the first k, top-p the
    shortest prefix whose probability reaches p (always at least the first token)."""
    ordered, order = scores.sort(dim=-1, descending=True, stable=True)
    if use_top_k:
        ranks = torch.arange(scores.shape[1], device=scores.device)
        ordered = ordered.masked_fill(ranks[None, :] >= top_k[:, None], -math.inf)
    if use_top_p:
        probs = ordered.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # Rows with top_p = 1 are left alone: float rounding can push the running sum past 1.
        drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
        ordered = ordered.masked_fill(drop, -math.inf)
    return torch.empty_like(scores).scatter_(1, order, ordered)


def ref_filter_min_p(scores: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p times the most likely one; in log space that is a score
    below max + log(min_p) (log(0) = -inf keeps every token)."""
    threshold = scores.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]
    return scores.masked_fill(scores < threshold, -math.inf)


def ref_sample_rows(scores: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                    use_top_k: bool, use_top_p: bool, use_min_p: bool) -> torch.Tensor:
    """int64 ``[B]``: each row's sampled token from f32 ``scores [B, V]`` (-inf where masked), with the
    per-row parameters of ``SamplingBatch``; the ``use_*`` flags switch whole stages on."""
    scores = scores / temperature[:, None]
    if use_top_k or use_top_p:
        scores = ref_filter_top_k_top_p(scores, top_k, top_p, use_top_k, use_top_p)
    if use_min_p:
        scores = ref_filter_min_p(scores, min_p)
    noisy = scores.double() + rng.gumbel_noise(seeds, steps, scores.shape[1])
    return noisy.argmax(dim=-1)


@triton.jit
def _mix64(x):
    # rng.mix64 on uint64, where shifts are logical and products wrap modulo 2^64 as splitmix64 wants.
    x = (x ^ (x >> 30)) * _M1
    x = (x ^ (x >> 27)) * _M2
    return x ^ (x >> 31)


@triton.jit
def _scaled(row_ptr, idx, vocab, temperature):
    # The scaled scores and their order keys. div_rn: torch divides with IEEE rounding, and the cuts
    # compare these values exactly.
    valid = idx < vocab
    s = tl.div_rn(tl.load(row_ptr + idx, mask=valid, other=float("-inf")), temperature)
    bits = s.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, -(bits & 0x7FFFFFFF), bits)
    return s, tl.where(valid, key, _NO_KEY)


@triton.jit
def _sample_kernel(scores_ptr, out_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr, steps_ptr,
                   vocab, row_stride, USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr, USE_MIN_P: tl.constexpr,
                   BLOCK: tl.constexpr, PDL: tl.constexpr):
    await_previous_kernel(PDL)
    row = tl.program_id(0)
    row_ptr = scores_ptr + row.to(tl.int64) * row_stride
    temperature = tl.load(temperature_ptr + row)
    offs = tl.arange(0, BLOCK)

    # Lane-wise running values are reduced once after each loop, not every step.
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    high = tl.full([BLOCK], _NO_KEY, tl.int32)
    low = tl.full([BLOCK], _MAX_KEY, tl.int32)
    for start in range(0, vocab, BLOCK):
        s, key = _scaled(row_ptr, start + offs, vocab, temperature)
        top = tl.maximum(top, s)
        high = tl.maximum(high, key)
        low = tl.minimum(low, tl.where(key == _NO_KEY, _MAX_KEY, key))
    m = tl.max(top, 0)
    max_key = tl.max(high, 0).to(tl.int64)

    if USE_TOP_K or USE_TOP_P:
        # Without top-k, the cut is the lowest key and its ties all stay: every score survives.
        k = vocab
        if USE_TOP_K:
            k = tl.minimum(tl.load(top_k_ptr + row), vocab).to(tl.int32)
        lo = tl.min(low, 0).to(tl.int64)  # count(key >= lo) >= k
        hi = tl.where(k < vocab, max_key + 1, lo + 1)  # count(key >= hi) < k
        while hi - lo > 1:
            mid = (lo + (hi - lo) // 2).to(tl.int32)
            count = tl.zeros([BLOCK], tl.int32)
            lowest_above = tl.full([BLOCK], _MAX_KEY, tl.int32)
            highest_below = tl.full([BLOCK], _NO_KEY, tl.int32)
            for start in range(0, vocab, BLOCK):
                s, key = _scaled(row_ptr, start + offs, vocab, temperature)
                above = key >= mid
                count += above.to(tl.int32)
                lowest_above = tl.minimum(lowest_above, tl.where(above, key, _MAX_KEY))
                highest_below = tl.maximum(highest_below, tl.where(above, _NO_KEY, key))
            count_above = tl.sum(count, 0)
            enough = count_above >= k
            # Bounds move to keys present in the row, which ends the search as soon as no key lies
            # between them; with exactly k at or above, the lowest of those is the cut.
            next_lo = tl.min(lowest_above, 0).to(tl.int64)
            next_hi = tl.max(highest_below, 0).to(tl.int64) + 1
            lo = tl.where(enough, next_lo, lo)
            hi = tl.where(enough, tl.where(count_above == k, next_lo + 1, hi), next_hi)
        cut_k = lo.to(tl.int32)

        lanes_above = tl.zeros([BLOCK], tl.int32)
        mass = tl.zeros([BLOCK], tl.float32)
        at_cut = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(0, vocab, BLOCK):
            s, key = _scaled(row_ptr, start + offs, vocab, temperature)
            lanes_above += (key > cut_k).to(tl.int32)
            mass += tl.where(key > cut_k, tl.exp(s - m), 0.0)
            at_cut = tl.maximum(at_cut, tl.where(key == cut_k, s, float("-inf")))
        kept_ties_k = k - tl.sum(lanes_above, 0)
        total = tl.sum(mass, 0) + kept_ties_k * tl.exp(tl.max(at_cut, 0) - m)

    if USE_TOP_P:
        p = tl.load(top_p_ptr + row)
        # The mass above cut_k - 1 is all of Z (>= p), above max_key none (< p). Rows with p = 1 skip
        # the search and compare with +inf: they are unfiltered, as in the reference.
        lo = cut_k.to(tl.int64) - 1
        hi = tl.where(p < 1, max_key, lo + 1)
        p_limit = tl.where(p < 1, p, float("inf"))
        mass_above_hi = tl.zeros([], tl.float32)
        while hi - lo > 1:
            mid = (lo + (hi - lo) // 2).to(tl.int32)
            mass = tl.zeros([BLOCK], tl.float32)
            lowest_above = tl.full([BLOCK], _MAX_KEY, tl.int32)
            highest_at_or_below = tl.full([BLOCK], _NO_KEY, tl.int32)
            for start in range(0, vocab, BLOCK):
                s, key = _scaled(row_ptr, start + offs, vocab, temperature)
                above = key > mid
                mass += tl.where(above, tl.exp(s - m), 0.0)
                lowest_above = tl.minimum(lowest_above, tl.where(above, key, _MAX_KEY))
                highest_at_or_below = tl.maximum(highest_at_or_below, tl.where(above, _NO_KEY, key))
            mass_above = tl.sum(mass, 0)
            kept = mass_above / total < p
            hi = tl.where(kept, tl.max(highest_at_or_below, 0).to(tl.int64), hi)
            mass_above_hi = tl.where(kept, mass_above, mass_above_hi)
            lo = tl.where(kept, lo, tl.min(lowest_above, 0).to(tl.int64) - 1)
        cut_p = hi.to(tl.int32)
        mass_before_cut_p = mass_above_hi / total

    if USE_MIN_P:
        # log in float64, rounded once: the correctly rounded f32 log torch's logf almost always gives.
        min_score = m + tl.log(tl.load(min_p_ptr + row).to(tl.float64)).to(tl.float32)

    row_key = _mix64(_mix64(tl.load(seeds_ptr + row).to(tl.uint64, bitcast=True))
                     + tl.load(steps_ptr + row).to(tl.uint64, bitcast=True))
    best = tl.full([BLOCK], float("-inf"), tl.float64)
    best_id = tl.full([BLOCK], vocab, tl.int32)
    ties_k_before = tl.zeros([], tl.int32)
    ties_p_before = tl.zeros([], tl.int32)
    for start in range(0, vocab, BLOCK):
        idx = start + offs
        s, key = _scaled(row_ptr, idx, vocab, temperature)
        keep = idx < vocab
        if USE_TOP_K or USE_TOP_P:
            # Ranks among the ties at a cut, in id order across the whole row (an exclusive scan).
            at_k = key == cut_k
            rank_k = ties_k_before + tl.cumsum(at_k.to(tl.int32), 0) - 1
            ties_k_before += tl.sum(at_k.to(tl.int32), 0)
            keep &= (key > cut_k) | (at_k & (rank_k < kept_ties_k))
        if USE_TOP_P:
            at_p = key == cut_p
            rank_p = ties_p_before + tl.cumsum(at_p.to(tl.int32), 0) - 1
            ties_p_before += tl.sum(at_p.to(tl.int32), 0)
            prob = tl.exp(s - m) / total
            keep &= (key > cut_p) | (at_p & (mass_before_cut_p + rank_p * prob < p_limit))
        if USE_MIN_P:
            keep &= s >= min_score
        # rng.gumbel_noise, operation for operation.
        bits = _mix64(row_key + (idx + 1).to(tl.uint64) * _GOLDEN)
        uniform = ((bits >> 12).to(tl.float64) + 0.5) * 2.0 ** -52
        noise = -tl.log(-tl.log(uniform))
        noisy = tl.where(keep, s.to(tl.float64), float("-inf")) + noise
        # Each lane sees ids in increasing order, so a strict > keeps its first maximum; a lane's first
        # id is taken whatever its value, so a row of -inf yields id 0 as torch's argmax does.
        better = (idx < vocab) & ((noisy > best) | (best_id == vocab))
        best = tl.where(better, noisy, best)
        best_id = tl.where(better, idx, best_id)
    winner = tl.max(best, 0)
    tl.store(out_ptr + row, tl.min(tl.where(best == winner, best_id, vocab), 0).to(tl.int64))


def sample_rows(scores: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                use_top_k: bool, use_top_p: bool, use_min_p: bool) -> torch.Tensor:
    """Each row's sampled token: the Triton kernel for CUDA tensors, the torch reference otherwise."""
    sampler = triton_sample_rows if scores.is_cuda else ref_sample_rows
    return sampler(scores, temperature, top_k, top_p, min_p, seeds, steps, use_top_k, use_top_p, use_min_p)


def triton_sample_rows(scores: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                       use_top_k: bool, use_top_p: bool, use_min_p: bool,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """int64 ``[B]``: ``ref_sample_rows`` of the same inputs (see the module docstring for where the
    two may differ). ``scores`` is f32 ``[B, V]`` with contiguous rows; the per-row parameters are
    contiguous ``[B]`` tensors of ``SamplingBatch``'s dtypes. One launch, nothing read back to the
    host, so it can be captured in a CUDA graph."""
    kernel = "sample_rows"
    require(scores.dim() == 2 and scores.shape[1] > 0, kernel,
            lambda: f"scores must be [B, V] with V > 0, got {tuple(scores.shape)}")
    require(scores.dtype == torch.float32, kernel, lambda: f"scores must be f32, got {scores.dtype}")
    require_unit_last_stride(kernel, "scores", scores)
    rows, vocab = scores.shape
    # Ids, counts and ranks are int32.
    require(vocab < 2 ** 31 - 1, kernel, lambda: f"rows of {vocab} elements exceed the kernel's int32 ids")
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=scores.device)
    params = dict(temperature=(temperature, torch.float32), top_k=(top_k, torch.int64), top_p=(top_p, torch.float32),
                  min_p=(min_p, torch.float32), seeds=(seeds, torch.int64), steps=(steps, torch.int64),
                  out=(out, torch.int64))
    for name, (t, dtype) in params.items():
        require(t.dtype == dtype and t.shape == (rows,) and t.is_contiguous(), kernel,
                lambda: f"{name} must be contiguous {dtype} [{rows}], got {t.dtype} {tuple(t.shape)} {t.stride()}")
    require_device(kernel, scores, *(t for t, _ in params.values()))
    if rows == 0:
        return out
    _sample_kernel[(rows,)](
        scores, out, temperature, top_k, top_p, min_p, seeds, steps, vocab, scores.stride(0),
        USE_TOP_K=use_top_k, USE_TOP_P=use_top_p, USE_MIN_P=use_min_p, BLOCK=SAMPLE_BLOCK, num_warps=8,
        **pdl_launch(scores))
    return out
