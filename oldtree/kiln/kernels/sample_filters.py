"""Top-k and top-p of ``sample.py``'s sampler as one cut per row: the first of its two launches.

``sample.py``'s docstring gives the rules and the algorithm; this module owns the order keys, the
launch that writes them (``keys_and_cut_kernel``, programs (row, chunk)) and the search for the cuts
that a row's last program runs over them. The search returns one combined cut: the draw keeps a
token when its key is above ``cut``, or equal to it with an id at most ``last_id``.

Each step of a bisection is one pass counting (for top-p, also summing ``exp(s - m)``) the keys
above a pivot, and one program makes every pass, so a pass costs reads in sequence. To keep them
short, a pass reads a *candidate list*: the ids, in id order, whose key is at least a floor. The
list starts as the row's int32 keys (ids implicit). When a search's lower bound rises so far that
at most half of the list, and at most ``cap`` ids, lie at or above it, the next pass also copies
those ids to a buffer, packed as ``key << 32 | id`` in an int64 (two buffers of ``cap``, taking
turns), and later passes read the shorter list. A floor never passes a bound the search still
needs: top-k raises it to its lower bound, below which no key can be its cut; top-p searches at or
above ``cut_k`` and raises it past keys it drops. Ties at ``cut_k`` leave the list only once top-p
drops them, so the last pass still ranks every tie that matters.

Pivots alternate between the keys' midpoint and the values' (see ``_pivot``): on rows of 49k-128k
normal scores with top-k 50 and top-p 0.9 that is 3 passes over the whole row, then passes over
lists of tens to thousands of ids (halving keys alone took 5-6 whole passes). Counts and keys are
exact, so top-k's cut and ties do not depend on the path; top-p's masses are summed over the list,
in another order than over the row, which moves them by float rounding only (see ``sample.py`` on
what that may change).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_support import await_previous_kernel

# The key of ids past the list's end: below -inf's key (-0x7F800000), so no count, cut or floor
# includes them.
NO_KEY = tl.constexpr(-(2 ** 31))
MAX_KEY = tl.constexpr(2 ** 31 - 1)
# The key of the largest finite f32.
_MAX_FINITE = tl.constexpr(0x7F7FFFFF)
# A list entry past its end: NO_KEY packed with id 0.
_NO_PACKED = tl.constexpr(-(2 ** 63))


@triton.jit
def order_key(s):
    # The int32 of an f32 whose integer order is the float order: its bits, with the magnitude
    # negated for negative values (-0.0 and 0.0 share key 0).
    bits = s.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


@triton.jit
def key_value(key):
    # The f32 of a key. Key 0 gives 0.0 for -0.0 too, which compares, exps and adds the same.
    bits = tl.where(key < 0, (-key) | NO_KEY, key)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def scaled(row_ptr, idx, valid, temperature):
    # The scaled scores and their order keys. div_rn: torch divides with IEEE rounding, and the cuts
    # compare these values exactly.
    s = tl.div_rn(tl.load(row_ptr + idx, mask=valid, other=float("-inf")), temperature)
    return s, tl.where(valid, order_key(s), NO_KEY)


@triton.jit
def _pivot(lo, hi, step):
    # A key strictly between the int64 bounds. Even steps halve the key range, so a search ends
    # within 64 steps whatever the values span; odd steps take the midpoint of the bounds' values
    # (clamped to finite ones), which reaches the scores' scale in a step or two where halving keys
    # spends a step per power of two. A value midpoint not strictly inside falls back to the keys'.
    by_key = lo + (hi - lo) // 2
    low = key_value(tl.maximum(lo, -_MAX_FINITE).to(tl.int32))
    high = key_value(tl.minimum(hi, _MAX_FINITE).to(tl.int32))
    by_value = order_key(0.5 * low + 0.5 * high).to(tl.int64)
    return tl.where((step % 2 == 1) & (by_value > lo) & (by_value < hi), by_value, by_key).to(tl.int32)


@triton.jit
def _load_list(keys_row, cand_row, src, i, n):
    # Elements i of the list at src: -1 is the row's keys (written by other programs, so read from
    # L2), else an offset into this row's candidate buffers.
    valid = i < n
    if src < 0:
        key = tl.load(keys_row + i, mask=valid, other=NO_KEY, cache_modifier=".cg")
        ident = i
    else:
        packed = tl.load(cand_row + src + i, mask=valid, other=_NO_PACKED)
        key = (packed >> 32).to(tl.int32)
        ident = packed.to(tl.int32)
    return key, ident


@triton.jit
def _scan(keys_row, cand_row, src, n, dst, floor, compact, t, m, BLOCK: tl.constexpr, MASS: tl.constexpr):
    """One pass over a list: the count (and with MASS the sum of exp(s - m)) of keys above t, the
    lowest key above t and the highest at or below it; with ``compact``, the ids whose key is at
    least ``floor`` are copied to ``dst``, and their number is returned last."""
    offs = tl.arange(0, BLOCK)
    # Lane-wise running values are reduced once after the loop, not every step.
    count = tl.zeros([BLOCK], tl.int32)
    mass = tl.zeros([BLOCK], tl.float32)
    lowest = tl.full([BLOCK], MAX_KEY, tl.int32)
    highest = tl.full([BLOCK], NO_KEY, tl.int32)
    written = tl.zeros([], tl.int32)
    for start in range(0, n, BLOCK):
        key, ident = _load_list(keys_row, cand_row, src, start + offs, n)
        above = key > t
        count += above.to(tl.int32)
        if MASS:
            mass += tl.where(above, tl.exp(key_value(key) - m), 0.0)
        lowest = tl.minimum(lowest, tl.where(above, key, MAX_KEY))
        highest = tl.maximum(highest, tl.where(above, NO_KEY, key))
        if compact:
            take = key >= floor
            at = written + tl.cumsum(take.to(tl.int32), 0) - 1
            tl.store(cand_row + dst + at, (key.to(tl.int64) << 32) | ident.to(tl.int64), mask=take)
            written += tl.sum(take.to(tl.int32), 0)
    # The next pass may read what this one wrote, from other threads of the program.
    tl.debug_barrier()
    return tl.sum(count, 0), tl.sum(mass, 0), tl.min(lowest, 0), tl.max(highest, 0), written


@triton.jit
def _next_list(src, n, dst, compact, written, cap):
    # After a compacting pass its copy is the list, and the buffer it read is free for the next copy.
    return tl.where(compact, dst, src), tl.where(compact, written, n), tl.where(compact, cap - dst, dst)


@triton.jit
def _last_kept_ties(keys_row, cand_row, src, n, cut_k, kept_ties_k, cut_p, mass_before, prob, p_limit,
                    BLOCK: tl.constexpr, USE_TOP_P: tl.constexpr):
    # The rules at the cuts as ids, from one pass in id order: top-k keeps the first kept_ties_k ties
    # at cut_k; top-p keeps a tie at cut_p while mass_before + rank * prob < p_limit, which holds for
    # a prefix of the ranks (both sides round monotonically), so its last kept id stands for it.
    offs = tl.arange(0, BLOCK)
    last_k = tl.full([BLOCK], -1, tl.int32)
    last_p = tl.full([BLOCK], -1, tl.int32)
    ties_k_before = tl.zeros([], tl.int32)
    ties_p_before = tl.zeros([], tl.int32)
    for start in range(0, n, BLOCK):
        key, ident = _load_list(keys_row, cand_row, src, start + offs, n)
        at_k = key == cut_k
        rank_k = ties_k_before + tl.cumsum(at_k.to(tl.int32), 0) - 1
        ties_k_before += tl.sum(at_k.to(tl.int32), 0)
        last_k = tl.maximum(last_k, tl.where(at_k & (rank_k < kept_ties_k), ident, -1))
        if USE_TOP_P:
            at_p = key == cut_p
            rank_p = ties_p_before + tl.cumsum(at_p.to(tl.int32), 0) - 1
            ties_p_before += tl.sum(at_p.to(tl.int32), 0)
            last_p = tl.maximum(last_p, tl.where(at_p & (mass_before + rank_p * prob < p_limit), ident, -1))
    last_id = tl.max(last_k, 0)
    if USE_TOP_P:
        # Above cut_k top-k keeps everything; at a shared cut a tie must pass both rules.
        last_id = tl.where(cut_p == cut_k, tl.minimum(last_id, tl.max(last_p, 0)), tl.max(last_p, 0))
    return last_id


@triton.jit
def _row_cut(keys_row, cand_row, cap, vocab, min_key, max_key, k, p, USE_TOP_P: tl.constexpr, BLOCK: tl.constexpr):
    """(cut, last_id) of a row whose int32 keys are at ``keys_row``: top-k with ``k`` (``vocab`` when
    off), then with ``USE_TOP_P`` top-p with ``p``; ``cand_row`` holds two buffers of ``cap``."""
    m = key_value(max_key)
    # The list the next pass reads (src -1: the row) and its length, where the next copy goes, and
    # whether the next pass makes it (compact) with which floor.
    src = tl.full([], -1, tl.int32)
    n = tl.full([], 0, tl.int32) + vocab
    dst = tl.zeros([], tl.int32)
    floor = min_key
    compact = tl.zeros([], tl.int1)

    # Top-k: cut_k is the largest key with at least k scores at or above it. count(>= lo) >= k and
    # count(>= hi) < k; without top-k the cut is the lowest key and its ties all stay.
    lo = min_key.to(tl.int64)
    hi = tl.where(k < vocab, max_key.to(tl.int64) + 1, lo + 1)
    step = tl.zeros([], tl.int32)
    while hi - lo > 1:
        mid = _pivot(lo, hi, step)
        step += 1
        count, _, lowest, highest, written = _scan(keys_row, cand_row, src, n, dst, floor, compact, mid - 1, m,
                                                   BLOCK, False)
        src, n, dst = _next_list(src, n, dst, compact, written, cap)
        enough = count >= k
        # Bounds move to keys present in the row, which ends the search as soon as no key lies
        # between them; with exactly k at or above, the lowest of those is the cut.
        lo = tl.where(enough, lowest.to(tl.int64), lo)
        hi = tl.where(enough, tl.where(count == k, lowest.to(tl.int64) + 1, hi), highest.to(tl.int64) + 1)
        compact = enough & (count <= n // 2) & (count <= cap)
        floor = tl.where(compact, lowest, floor)
    cut_k = lo.to(tl.int32)

    # The mass above cut_k and its kept ties: Z, which normalizes over the top-k survivors.
    count, mass, _, _, written = _scan(keys_row, cand_row, src, n, dst, floor, compact, cut_k, m, BLOCK, USE_TOP_P)
    src, n, dst = _next_list(src, n, dst, compact, written, cap)
    compact = tl.zeros([], tl.int1)
    kept_ties_k = k - count
    if USE_TOP_P:
        total = mass + kept_ties_k * tl.exp(key_value(cut_k) - m)

        # Top-p: cut_p is the smallest key whose mass strictly above, over Z, is below p. The mass
        # above cut_k - 1 is all of Z (>= p), above max_key none (< p). Rows with p = 1 skip the
        # search and compare with +inf: they are unfiltered, as in the reference.
        lo = cut_k.to(tl.int64) - 1
        hi = tl.where(p < 1, max_key.to(tl.int64), lo + 1)
        p_limit = tl.where(p < 1, p, float("inf"))
        mass_above_hi = tl.zeros([], tl.float32)
        step = tl.zeros([], tl.int32)
        while hi - lo > 1:
            mid = _pivot(lo, hi, step)
            step += 1
            count, mass, lowest, highest, written = _scan(keys_row, cand_row, src, n, dst, floor, compact, mid, m,
                                                          BLOCK, True)
            src, n, dst = _next_list(src, n, dst, compact, written, cap)
            kept = mass / total < p
            hi = tl.where(kept, highest.to(tl.int64), hi)
            mass_above_hi = tl.where(kept, mass, mass_above_hi)
            lo = tl.where(kept, lo, lowest.to(tl.int64) - 1)
            compact = (kept == 0) & (count <= n // 2) & (count <= cap)
            floor = tl.where(compact, lowest, floor)
        cut = hi.to(tl.int32)
        prob = tl.exp(key_value(cut) - m) / total
        last_id = _last_kept_ties(keys_row, cand_row, src, n, cut_k, kept_ties_k, cut, mass_above_hi / total, prob,
                                  p_limit, BLOCK, True)
    else:
        cut = cut_k
        last_id = _last_kept_ties(keys_row, cand_row, src, n, cut_k, kept_ties_k, cut_k, 0.0, 0.0, 0.0, BLOCK, False)
    return cut, last_id


@triton.jit
def keys_and_cut_kernel(scores_ptr, keys_ptr, meta_ptr, cand_ptr, counter_ptr, temperature_ptr, top_k_ptr, top_p_ptr,
                        vocab, row_stride, num_chunks, cap, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                        MERGE: tl.constexpr, USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr, PDL: tl.constexpr):
    """Program (row, chunk) writes its chunk's order keys to ``keys_ptr`` and their largest and
    smallest to the row's ``meta`` (words ``chunk`` and ``num_chunks + chunk``); the row's last
    program writes the cut, its last kept id and the row's largest key at word ``3 * num_chunks``."""
    await_previous_kernel(PDL)
    row = tl.program_id(0)
    c = tl.program_id(1)
    start = c * CHUNK
    end = tl.minimum(start + CHUNK, vocab)
    scores_row = scores_ptr + row.to(tl.int64) * row_stride
    keys_row = keys_ptr + row.to(tl.int64) * vocab
    meta_row = meta_ptr + row * (3 * num_chunks + 3)
    temperature = tl.load(temperature_ptr + row)
    offs = tl.arange(0, BLOCK)
    high = tl.full([BLOCK], NO_KEY, tl.int32)
    low = tl.full([BLOCK], MAX_KEY, tl.int32)
    for i0 in range(start, end, BLOCK):
        idx = i0 + offs
        valid = idx < end
        _, key = scaled(scores_row, idx, valid, temperature)
        tl.store(keys_row + idx, key, mask=valid)
        high = tl.maximum(high, key)
        low = tl.minimum(low, tl.where(valid, key, MAX_KEY))
    tl.store(meta_row + c, tl.max(high, 0))
    tl.store(meta_row + num_chunks + c, tl.min(low, 0))
    # The last ticket sees every chunk's keys and partials: the barrier + acq_rel atomic of
    # argmax._argmax_kernel, whose comment says why; the search reads them from L2 (.cg).
    tl.debug_barrier()
    counter = counter_ptr + row
    ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if ticket == num_chunks - 1:
        highs = tl.full([MERGE], NO_KEY, tl.int32)
        lows = tl.full([MERGE], MAX_KEY, tl.int32)
        for c0 in range(0, num_chunks, MERGE):
            cs = c0 + tl.arange(0, MERGE)
            highs = tl.maximum(highs, tl.load(meta_row + cs, mask=cs < num_chunks, other=NO_KEY, cache_modifier=".cg"))
            lows = tl.minimum(lows, tl.load(meta_row + num_chunks + cs, mask=cs < num_chunks, other=MAX_KEY,
                                            cache_modifier=".cg"))
        max_key = tl.max(highs, 0)
        # Without top-k and top-p every key is above the cut.
        cut = tl.full([], NO_KEY, tl.int32)
        last_id = tl.full([], -1, tl.int32)
        if USE_TOP_K or USE_TOP_P:
            k = vocab
            if USE_TOP_K:
                k = tl.minimum(tl.load(top_k_ptr + row), vocab).to(tl.int32)
            p = 1.0
            if USE_TOP_P:
                p = tl.load(top_p_ptr + row)
            cut, last_id = _row_cut(keys_row, cand_ptr + row.to(tl.int64) * (2 * cap), cap, vocab, tl.min(lows, 0),
                                    max_key, k, p, USE_TOP_P, BLOCK)
        tl.store(meta_row + 3 * num_chunks, cut)
        tl.store(meta_row + 3 * num_chunks + 1, last_id)
        tl.store(meta_row + 3 * num_chunks + 2, max_key)
        tl.store(counter, 0)
