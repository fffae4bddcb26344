"""What the Triton kernels of the LoRA ops share: the shrink (``h = x @ A[s].T``, ``lora_shrink``) and the
expand (``y += h @ B[s].T`` per slice, ``lora_expand``), a launch each, on the step's grouping
(``lora_groups.py``).

Two layouts of the same two steps:
- one row (``lora_row_triton.py``): a step of one token, K split over programs so the GPU is not
  left to a program walking all of K;
- tiles (``lora_tile_triton.py``): every other step, decode and prefill alike: a program takes a
  tile of the grouping (up to ``TILE_ROWS`` rows of one adapter), so the products are ``tl.dot``
  tiles and each adapter's A and B are read once per tile, not once per row or per sequence.

Each K split writes its partial sums to a plane of its own (h itself without splits): no zeroed
buffer to fill first, no atomic add of the sums. Then it takes a ticket from its unit's counter (the
device's shared semaphore counters, ``triton_support.semaphore_counters``), and the program that
draws the last one adds the unit's planes into h (the pattern of ``attention_split_merge``): every
expand program reads h only, instead of every plane again (at Llama-3-8B's shape, batch 64, the
expand programs re-read 4-6 times the bytes of B in planes). The expand reads slice
``i``'s rows of h (``i*R .. i*R + R``) for the columns of y in slice ``i`` (up to three slices: fused
q/k/v); it adds in f32 and rounds once into y. Under the interpreter (and for f32) the products are
f32, as ``dot_in_f32`` says. All launch with programmatic dependent launch (``KernelConfig.pdl``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import KernelConfig
from .triton_support import pow2

# What x is (the op's ``prologue``): the GEMM input itself, an RMSNorm's input (normalized and scaled
# here, rounded as the unfused norm rounds), or the gate/up GEMM's output (silu(gate) * up made here).
PROLOGUE_CODES = {"none": 0, "rmsnorm": 1, "silu_mul": 2}


@triton.jit
def _gemm_input(ptrs, mask, norm_ptrs, k_mask, up_offset, rstd, PROLOGUE: tl.constexpr):
    """The GEMM input's elements at ``ptrs`` (into x) under ``mask``; ``rstd`` broadcasts over them.
    Products are taken in f32 and rounded to x's dtype where the unfused ops round."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    dtype = x.dtype
    if PROLOGUE == 1:
        g = tl.load(norm_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        x = (g * (x.to(tl.float32) * rstd.to(tl.float32)).to(dtype).to(tl.float32)).to(dtype)
    elif PROLOGUE == 2:
        up = tl.load(ptrs + up_offset, mask=mask, other=0.0).to(tl.float32)
        gate = x.to(tl.float32)
        x = ((gate * tl.sigmoid(gate)).to(dtype).to(tl.float32) * up).to(dtype)
    return x


@triton.jit
def _last_split(counter_ptr, SPLITS):
    """Takes this program's ticket from its unit's counter: True for the program that draws the last
    of the unit's ``SPLITS``, which puts the counter back to zero (no program of the launch touches it
    after its ticket; the stream orders the reset before the next launch)."""
    # The barrier orders this program's stores before the atomic, whose gpu-scope release publishes
    # them; the tickets form one release sequence, so the last ticket acquires every split's stores
    # (as in attention_decode._decode_kernel); the merge then loads from L2 (.cg).
    tl.debug_barrier()
    last = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == SPLITS - 1
    tl.store(counter_ptr, 0, mask=last)
    return last


@triton.jit
def _sum_planes(part_ptr, offsets, mask, SPLITS, split_stride, PLANE_BLOCK: tl.constexpr):
    """The sum over ``SPLITS`` planes (``split_stride`` apart) of the elements at ``offsets``, added
    in plane order. The merge is the tail of the shrink's critical path (one program a unit, after
    every split), so the loads of ``PLANE_BLOCK`` planes are issued together, unrolled and
    independent: one round trip to L2 for them all where a loop of one load a plane made one each
    (a rolled loop waits for each load before the next, as the add needs it)."""
    total = tl.load(part_ptr + offsets, mask=mask, other=0.0, cache_modifier=".cg")
    for s0 in range(1, SPLITS, PLANE_BLOCK):
        for j in tl.static_range(PLANE_BLOCK):
            total += tl.load(part_ptr + (s0 + j) * split_stride + offsets, mask=mask & (s0 + j < SPLITS), other=0.0,
                             cache_modifier=".cg")
    return total


@triton.jit
def _column_block(n0, n_end, END0, END1, BLOCK_N: tl.constexpr):
    """An expand step's output columns from ``n0`` (those before ``n_end``) and each one's slice:
    how many of the slice ends ``END0``, ``END1`` it is at or past."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    piece = (offs_n >= END0).to(tl.int32) + (offs_n >= END1).to(tl.int32)
    return offs_n, offs_n < n_end, piece


def slice_ends(slices: tuple[int, ...], n: int) -> list[int]:
    """Where slices 0 and 1 end among y's n columns (n past the last slice): a column's slice is how
    many of the two it is at or past."""
    return [sum(slices[:i + 1]) for i in range(len(slices) - 1)] + [n] * (3 - len(slices))


def split_k(k: int, step: int, programs: int, sms: int, config: KernelConfig) -> tuple[int, int]:
    """(splits, in-features a split): K split so that ``programs`` programs a split make about
    ``lora_shrink_programs_per_sm`` programs an SM, each split a whole number of ``step`` blocks.
    More than one an SM: a program's loop over its split is a chain of round trips (a few blocks in
    flight at a time), so shorter splits shorten the kernel as long as the merge's planes stay few."""
    k_blocks = triton.cdiv(k, step)
    wanted = sms * config.lora_shrink_programs_per_sm // max(programs, 1)
    splits = max(1, min(k_blocks, config.lora_max_splits, wanted))
    per_split = triton.cdiv(k_blocks, splits) * step
    return triton.cdiv(k, per_split), per_split


def planes_for(h: torch.Tensor, splits: int) -> torch.Tensor:
    """Where the shrink's splits write: h itself for one, else a plane each (never zeroed: each
    split writes every element of its plane that the merge reads)."""
    return h if splits == 1 else torch.empty((splits, *h.shape), dtype=h.dtype, device=h.device)


def column_runs(n: int, block_n: int, units: int, sms: int, config: KernelConfig) -> int:
    """Output columns an expand program walks for ``units`` rows or tiles in use: runs of at most
    ``lora_expand_steps`` blocks, fewer where that leaves fewer than ``lora_expand_programs_per_sm``
    programs an SM (programs without rows return at once, so the grid stays a few programs a row or
    tile instead of one per block of columns)."""
    n_blocks = triton.cdiv(n, block_n)
    wanted = triton.cdiv(config.lora_expand_programs_per_sm * sms, units)
    count = min(n_blocks, max(triton.cdiv(n_blocks, config.lora_expand_steps), wanted))
    return triton.cdiv(n_blocks, count) * block_n


def rank_block(nr: int) -> int:
    """h's columns a shrink program makes."""
    return min(pow2(nr, 16), 64)
