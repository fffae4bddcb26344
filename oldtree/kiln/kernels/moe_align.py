"""Token sorting by expert, block-aligned (what vLLM and SGLang call ``moe_align_block_size``).

The grouped GEMMs (``moe_gemm.py``) take rows ``block_m`` at a time, all of one expert. This kernel
lays a step's (token, choice) pairs out so: each expert's pairs (by their flat index ``t * K + j``)
in a run padded up to a multiple of ``block_m`` with the pad value ``T * K``, the runs in expert
order. It returns the sorted pairs, the expert of each block (-1 past the end) and the padded total.
All sizes are bounds known before the step (``T*K + E*(block_m - 1)`` pairs at most), so nothing is
read back to the host and a step that runs it can be captured.

Pairs whose expert is not local (``expert_offset``: another rank's experts under expert parallelism)
are left out. One program does the whole step: it counts pairs per expert, takes the padded
prefix sums, then places each chunk of pairs by its rank among the earlier pairs of its expert.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_support import pow2


def aligned_capacity(pairs: int, experts: int, block_m: int) -> int:
    """Most sorted slots ``pairs`` pairs over ``experts`` experts need: every run padded by < block_m."""
    return pairs + experts * (block_m - 1)


def ref_moe_align(ids: torch.Tensor, experts: int, block_m: int,
                  expert_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(sorted pairs [capacity], expert per block [capacity // block_m rounded up], padded total)."""
    flat = ids.reshape(-1).long() - expert_offset
    pairs = flat.numel()
    capacity = aligned_capacity(pairs, experts, block_m)
    sorted_pairs = torch.full((capacity,), pairs, dtype=torch.int32, device=ids.device)
    block_experts = torch.full((triton.cdiv(capacity, block_m),), -1, dtype=torch.int32, device=ids.device)
    start = 0
    for expert in range(experts):
        chosen = torch.nonzero(flat == expert).flatten()
        sorted_pairs[start:start + chosen.numel()] = chosen.to(torch.int32)
        blocks = triton.cdiv(chosen.numel(), block_m)
        block_experts[start // block_m:start // block_m + blocks] = expert
        start += blocks * block_m
    return sorted_pairs, block_experts, start


@triton.jit
def _moe_align_kernel(ids_ptr, sorted_ptr, block_experts_ptr, total_ptr, pairs, experts, expert_offset, capacity,
                      blocks, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, CHUNK: tl.constexpr):
    expert_range = tl.arange(0, E_POW2)
    # Counts per expert.
    counts = tl.zeros([E_POW2], dtype=tl.int32)
    for start in range(0, pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < pairs, other=-1).to(tl.int32) - expert_offset
        hit = (e[:, None] == expert_range[None, :]) & (offs < pairs)[:, None] & (e[:, None] >= 0)
        counts += tl.sum(hit.to(tl.int32), axis=0)
    counts = tl.where(expert_range < experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(total_ptr, tl.sum(padded, axis=0))
    # Every slot first holds the pad value, every block no expert; then the blocks' experts: block b
    # belongs to the first expert whose run ends after b * BLOCK_M.
    for start in range(0, capacity, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + offs, tl.zeros([CHUNK], dtype=tl.int32) + pairs, mask=offs < capacity)
    for start in range(0, blocks, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        before = tl.sum((ends[None, :] <= (offs * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        expert = tl.where(before < experts, before, -1)
        tl.store(block_experts_ptr + offs, expert, mask=offs < blocks)
    tl.debug_barrier()  # the pad fill above must land before the pairs below overwrite it
    # Each pair goes to its expert's start + the pairs of that expert placed before it.
    placed = tl.zeros([E_POW2], dtype=tl.int32)
    for start in range(0, pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < pairs, other=-1).to(tl.int32) - expert_offset
        hit = ((e[:, None] == expert_range[None, :]) & (offs < pairs)[:, None]
               & (e[:, None] >= 0)).to(tl.int32)
        rank_in_chunk = tl.cumsum(hit, axis=0) - hit
        slot = tl.sum(hit * (starts + placed)[None, :] + hit * rank_in_chunk, axis=1)
        tl.store(sorted_ptr + slot, offs.to(tl.int32), mask=tl.sum(hit, axis=1) > 0)
        placed += tl.sum(hit, axis=0)


def triton_moe_align(ids: torch.Tensor, experts: int, block_m: int, expert_offset: int = 0, chunk: int = 64,
                     out: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted pairs, expert per block, padded total as a one-element device tensor). ``out``: the
    sorted pairs' and the blocks' buffers (int32, contiguous), filled whole; they may be shorter than
    the capacity bound when the caller knows a tighter one (every run padded holds a pair, so the
    padded total is at most ``pairs * block_m`` too)."""
    flat = ids.reshape(-1)
    if out is None:
        capacity = aligned_capacity(flat.numel(), experts, block_m)
        out = (torch.empty(capacity, dtype=torch.int32, device=ids.device),
               torch.empty(triton.cdiv(capacity, block_m), dtype=torch.int32, device=ids.device))
    sorted_pairs, block_experts = out
    capacity, blocks = sorted_pairs.numel(), block_experts.numel()
    total = torch.empty(1, dtype=torch.int32, device=ids.device)
    _moe_align_kernel[(1,)](flat, sorted_pairs, block_experts, total, flat.numel(), experts, expert_offset, capacity,
                            blocks, BLOCK_M=block_m, E_POW2=pow2(experts), CHUNK=chunk, num_warps=4)
    return sorted_pairs, block_experts, total
