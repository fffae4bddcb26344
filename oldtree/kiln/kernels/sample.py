"""The sampled rows of a decode step: temperature, top-k, top-p and min-p, then the Gumbel-max draw.

``ref_sample_rows`` is what ``sampler.sample`` does for non-greedy rows once penalties, bias and
grammar are applied: scores divided by temperature; top-k and top-p on the distribution sorted from
the most likely token down (stable, so equal scores keep id order); min-p; then the token is
``argmax(scores + gumbel)`` with float64 noise from ``rng`` keyed by (seed, step, vocab id).
The full-vocabulary sort makes it ~0.8 ms a step on a GPU.

``triton_sample_rows`` gets the same tokens without sorting, in two launches over programs
(row, chunk of ``KernelConfig.sample_chunk`` ids): the work on every score is spread over them, and only the
search for the cuts runs in one program per row.

1. keys and cut (``sample_filters``): each program divides its chunk by the temperature and writes
   the int32 order keys of the scaled scores ``s`` (an f32's bits with the magnitude negated for
   negative values: integer order is float order, -0.0 and 0.0 are one key, and ``s`` is recovered
   from its key), with the chunk's largest and smallest key. The row's last program to finish (a
   ticket, as in ``argmax``) reduces those to the row's largest key, whose value is the top-1 score
   ``m``, and its smallest, and searches the cuts over the keys:

   - top-k: bisection over keys for ``cut_k``, the largest key with at least k scores at or above
     it. Each step counts the keys at or above a pivot and moves the bound to the nearest key
     present, stopping early when exactly k are above (8-13 steps on normally distributed rows of
     49k-128k scores). Scores above ``cut_k`` are kept, and of those at ``cut_k`` the first
     ``k - count above`` by id, as the stable sort keeps them.
   - the mass ``sum(exp(s - m))`` above ``cut_k``, so that ``Z = mass above + kept ties * exp(score
     at cut - m)`` normalizes over the top-k survivors.
   - top-p: the reference keeps a token when the probability of the tokens strictly before it in the
     sorted order is below p. Bisection over keys (at or above ``cut_k``) for ``cut_p``, the smallest
     key whose mass strictly above, over Z, is below p (3-9 steps); scores above it are kept, and a
     score at it is kept while ``mass above / Z + (its rank among the ties) * its probability < p``.
   - one pass in id order turns the rules at the cuts into one cut and the id of its last kept tie
     (the kept ties at a cut are a prefix of them in id order).

   Each step reads a list of the ids that can still matter, which shrinks as the bounds close.
2. draw: each program keeps the scores above the cut, those at it up to that id, and with min-p
   those at or above ``m + log(min_p)`` (``m`` is never filtered, so it is also the filtered row's
   max); it draws the noise (``rng``'s, in uint64 and float64 operation for operation) only in
   steps that keep a score, and the row's last program picks the lowest id of the largest ``score +
   noise`` over its chunks' best; a row that keeps only -inf gives id 0, as torch's argmax does.
   With every filter off the first launch is skipped and the draw divides by the temperature.

Exactness: scaling uses IEEE division as torch does (Triton's ``/`` is approximate on NVIDIA), keys
and counts are exact, so top-k keeps exactly the reference's tokens, and the noise's bits are
``rng``'s (its float64 ``log`` is libdevice's on the GPU, as torch's CUDA ``log``; numpy's under the
interpreter, which may differ from torch's CPU one by an ulp: that only matters for draws tied to
~1e-16). Top-p sums probabilities in another order than torch's cumsum (whose CPU and CUDA orders
differ too; the candidate lists and ``sample_block`` change ours), and ``exp`` and min-p's ``log``
may differ from torch's by an ulp, so a top-p or min-p cut that lands within float rounding of the
boundary may keep or drop one token more. The draw differs only if it lands that close and that
token also wins the draw: for random inputs about the running sum's rounding error, 1e-6 to 1e-5 a
row.

Cost: the single-program kernel this replaced (one program a row, every search step dividing the
whole row again, two float64 logs per score on that one SM) measured 0.29 ms for one row of 49k
scores and 1.13 ms for one of 128k with top-k 50, top-p 0.9, min-p 0.05 and temperature 0.7 on an
H200, at batch 1. Here the division and the noise run on rows x chunks programs (the noise only
where a score is kept), and the search's steps read int32 keys, then shrinking lists: on such rows
about 3 row lengths of reads in all, where each of the 20-30 steps read the whole row before (a
simulation in numpy). The split is not yet measured on a GPU. Scratch: 4 bytes a score for the
keys and two lists of ``sample_candidates`` int64 a row; no host synchronization, so the launches
can be captured in a CUDA graph.

Drawing is the runtime op ``sample_rows`` (``registry.impl_for_device``): the sampler calls it on a
step's scores.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import rng
from .config import DEFAULTS, KernelConfig
from .registry import register_impl
from .sample_filters import NO_KEY, key_value, keys_and_cut_kernel, scaled
from .triton_support import (await_previous_kernel, pdl_launch, pow2, require, require_device, require_unit_last_stride,
                             semaphore_counters)

_GOLDEN = tl.constexpr(rng.GOLDEN)
_M1 = tl.constexpr(rng.M1)
_M2 = tl.constexpr(rng.M2)


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
    scores = ref_filtered_scores(scores, temperature, top_k, top_p, min_p, use_top_k, use_top_p, use_min_p)
    noisy = scores.double() + rng.gumbel_noise(seeds, steps, scores.shape[1])
    return noisy.argmax(dim=-1)


def ref_filtered_scores(scores: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                        min_p: torch.Tensor, use_top_k: bool, use_top_p: bool, use_min_p: bool) -> torch.Tensor:
    """The logits of the distribution ``ref_sample_rows`` draws from: divided by the temperature,
    -inf where top-k, top-p and min-p drop a token (its softmax is the sampling distribution)."""
    scores = scores / temperature[:, None]
    if use_top_k or use_top_p:
        scores = ref_filter_top_k_top_p(scores, top_k, top_p, use_top_k, use_top_p)
    if use_min_p:
        scores = ref_filter_min_p(scores, min_p)
    return scores


@triton.jit
def _mix64(x):
    # rng.mix64 on uint64, where shifts are logical and products wrap modulo 2^64 as splitmix64 wants.
    x = (x ^ (x >> 30)) * _M1
    x = (x ^ (x >> 27)) * _M2
    return x ^ (x >> 31)


@triton.jit
def _draw_kernel(scores_ptr, keys_ptr, meta_ptr, best_ptr, out_ptr, counter_ptr, temperature_ptr, min_p_ptr,
                 seeds_ptr, steps_ptr, vocab, row_stride, num_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                 MERGE: tl.constexpr, FILTERED: tl.constexpr, USE_MIN_P: tl.constexpr, PDL: tl.constexpr):
    """Program (row, chunk) draws its chunk's best (noisy value to ``best_ptr``, id to word
    ``2 * num_chunks + chunk`` of the row's ``meta``), keeping what the cut in ``meta`` and min-p
    keep (with FILTERED; else every score, divided here); the row's last program writes its token."""
    await_previous_kernel(PDL)
    row = tl.program_id(0)
    c = tl.program_id(1)
    start = c * CHUNK
    end = tl.minimum(start + CHUNK, vocab)
    meta_row = meta_ptr + row * (3 * num_chunks + 3)
    if FILTERED:
        keys_row = keys_ptr + row.to(tl.int64) * vocab
        cut = tl.load(meta_row + 3 * num_chunks)
        last_id = tl.load(meta_row + 3 * num_chunks + 1)
        if USE_MIN_P:
            # m is the top-1 score, never filtered, so also the filtered row's max. log in float64,
            # rounded once: the correctly rounded f32 log torch's logf almost always gives.
            m = key_value(tl.load(meta_row + 3 * num_chunks + 2))
            min_score = m + tl.log(tl.load(min_p_ptr + row).to(tl.float64)).to(tl.float32)
    else:
        scores_row = scores_ptr + row.to(tl.int64) * row_stride
        temperature = tl.load(temperature_ptr + row)
    row_key = _mix64(_mix64(tl.load(seeds_ptr + row).to(tl.uint64, bitcast=True))
                     + tl.load(steps_ptr + row).to(tl.uint64, bitcast=True))
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float64)
    best_id = tl.full([BLOCK], vocab, tl.int32)
    for i0 in range(start, end, BLOCK):
        idx = i0 + offs
        valid = idx < end
        if FILTERED:
            key = tl.load(keys_row + idx, mask=valid, other=NO_KEY)
            s = key_value(key)
            keep = valid & ((key > cut) | ((key == cut) & (idx <= last_id)))
            if USE_MIN_P:
                keep &= s >= min_score
            # Most blocks keep nothing under top-k or top-p: they skip the noise, whose two float64
            # logs are most of the work.
            any_kept = tl.max(keep.to(tl.int32), 0) > 0
        else:
            s, _ = scaled(scores_row, idx, valid, temperature)
            keep = valid
            any_kept = True
        if any_kept:
            # rng.gumbel_noise, operation for operation.
            bits = _mix64(row_key + (idx + 1).to(tl.uint64) * _GOLDEN)
            uniform = ((bits >> 12).to(tl.float64) + 0.5) * 2.0 ** -52
            noise = -tl.log(-tl.log(uniform))
            noisy = tl.where(keep, s.to(tl.float64), float("-inf")) + noise
            # Each lane sees ids in increasing order, so a strict > keeps its first maximum.
            better = noisy > best
            best = tl.where(better, noisy, best)
            best_id = tl.where(better, idx, best_id)
    chunk_best = tl.max(best, 0)
    # A chunk with no draw above -inf: all its ids tie there, and the first is the lowest.
    chunk_id = tl.where(chunk_best == float("-inf"), start, tl.min(tl.where(best == chunk_best, best_id, vocab), 0))
    tl.store(best_ptr + row * num_chunks + c, chunk_best)
    tl.store(meta_row + 2 * num_chunks + c, chunk_id)
    # As in keys_and_cut_kernel: the last ticket sees every chunk's result.
    tl.debug_barrier()
    counter = counter_ptr + row
    ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if ticket == num_chunks - 1:
        winner = tl.full([], float("-inf"), tl.float64)
        for c0 in range(0, num_chunks, MERGE):
            cs = c0 + tl.arange(0, MERGE)
            values = tl.load(best_ptr + row * num_chunks + cs, mask=cs < num_chunks, other=float("-inf"),
                             cache_modifier=".cg")
            winner = tl.maximum(winner, tl.max(values, 0))
        # The lowest id of the largest value, as torch's argmax picks; a row of -inf gives id 0.
        token = tl.full([], vocab, tl.int32)
        for c0 in range(0, num_chunks, MERGE):
            cs = c0 + tl.arange(0, MERGE)
            values = tl.load(best_ptr + row * num_chunks + cs, mask=cs < num_chunks, other=float("-inf"),
                             cache_modifier=".cg")
            ids = tl.load(meta_row + 2 * num_chunks + cs, mask=cs < num_chunks, other=vocab, cache_modifier=".cg")
            token = tl.minimum(token, tl.min(tl.where(values == winner, ids, vocab), 0))
        tl.store(out_ptr + row, token.to(tl.int64))
        tl.store(counter, 0)


def triton_sample_rows(scores: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                       use_top_k: bool, use_top_p: bool, use_min_p: bool,
                       out: torch.Tensor | None = None, config: KernelConfig = DEFAULTS) -> torch.Tensor:
    """int64 ``[B]``: ``ref_sample_rows`` of the same inputs (see the module docstring for where the
    two may differ). ``scores`` is f32 ``[B, V]`` with contiguous rows; the per-row parameters are
    contiguous ``[B]`` tensors of ``SamplingBatch``'s dtypes. Two launches (one with every filter
    off), nothing read back to the host, so it can be captured in a CUDA graph once the shape has run
    eagerly (the first launch sizes the shared counters)."""
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
    chunk = config.sample_chunk
    chunks = triton.cdiv(vocab, chunk)
    block = min(config.sample_block, pow2(chunk))
    filtered = use_top_k or use_top_p or use_min_p
    counters = semaphore_counters(scores.device, rows)
    # Per row: each chunk's largest and smallest key, each chunk's winner, then the cut, its last kept
    # tie and the row's largest key.
    meta = torch.empty(rows, 3 * chunks + 3, dtype=torch.int32, device=scores.device)
    best = torch.empty(rows, chunks, dtype=torch.float64, device=scores.device)
    keys = meta  # never read without a filter; any tensor will do
    if filtered:
        keys = torch.empty(rows, vocab, dtype=torch.int32, device=scores.device)
        # The search's two candidate lists: a copy holds at most half the list it reads, so no list
        # needs more than half the row.
        cap = max(1, min(config.sample_candidates, vocab // 2))
        cands = torch.empty(rows, 2 * cap if use_top_k or use_top_p else 1, dtype=torch.int64, device=scores.device)
        keys_and_cut_kernel[(rows, chunks)](
            scores, keys, meta, cands, counters, temperature, top_k, top_p, vocab, scores.stride(0), chunks, cap,
            CHUNK=chunk, BLOCK=block, MERGE=config.sample_merge_block, USE_TOP_K=use_top_k, USE_TOP_P=use_top_p,
            num_warps=8, **pdl_launch(scores, config.pdl))
    _draw_kernel[(rows, chunks)](
        scores, keys, meta, best, out, counters, temperature, min_p, seeds, steps, vocab, scores.stride(0), chunks,
        CHUNK=chunk, BLOCK=block, MERGE=config.sample_merge_block, FILTERED=filtered, USE_MIN_P=use_min_p,
        num_warps=8, **pdl_launch(scores, config.pdl))
    return out


register_impl("sample_rows", "torch", ref_sample_rows)
register_impl("sample_rows", "triton", triton_sample_rows, priority=10, wants_config=True)
