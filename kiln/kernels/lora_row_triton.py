"""Triton kernels of the LoRA ops for a step of one token row (``lora_triton.py`` says the layouts).

One row would leave most of the GPU idle while a program walks all of K, so the shrink is a program
per block of h's columns and split of K (about one per SM), each split writing its partial sums to
a plane of its own that the block's last split adds into h. Under the RMSNorm prologue every split
needs the row's norm: it reads the row in wide blocks first (a few round trips). The expand is a
program per run of up to ``lora_expand_steps`` blocks of output columns. The row and its slot are the
grouping's first tile: slot -1 (no adapter) returns at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import KernelConfig
from .lora_triton import (_column_block, _gemm_input, _last_split, _sum_planes, column_runs, planes_for, rank_block,
                          slice_ends, split_k)
from .triton_support import await_previous_kernel, pdl_launch, pow2, semaphore_counters, sm_count


@triton.jit
def _shrink_row(x_ptr, a_ptr, h_ptr, part_ptr, counter_ptr, rows_ptr, tiles_ptr, norm_ptr, eps, K, NR, K_PER_SPLIT,
                x_stride, a_slot_stride, part_split_stride, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                NORM_BLOCK: tl.constexpr, PROLOGUE: tl.constexpr, SPLIT: tl.constexpr, PLANE_BLOCK: tl.constexpr,
                PDL: tl.constexpr):
    # Every program waits first, before any early return, so that this kernel's end still implies
    # the previous kernel's (the next PDL kernel relies on it); PDL overlaps the launch itself.
    await_previous_kernel(PDL)
    r_block, split = tl.program_id(0), tl.program_id(1)
    slot, row = tl.load(tiles_ptr), tl.load(rows_ptr).to(tl.int64)  # (both before the branch: one round trip)
    if slot < 0:
        return
    offs_r = r_block * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < NR
    a_base = a_ptr + slot.to(tl.int64) * a_slot_stride
    x_row = x_ptr + row * x_stride
    rstd = 0.0
    if PROLOGUE == 1:  # every split needs the whole row's norm: read in wide blocks, a few round trips
        squares = tl.zeros((NORM_BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, NORM_BLOCK):
            offs_k = k0 + tl.arange(0, NORM_BLOCK)
            v = tl.load(x_row + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            squares += v * v
        rstd = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    k_start = split * K_PER_SPLIT
    for k0 in range(k_start, tl.minimum(k_start + K_PER_SPLIT, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = _gemm_input(x_row + offs_k, k_ok, norm_ptr + offs_k, k_ok, K, rstd, PROLOGUE).to(tl.float32)
        a = tl.load(a_base + offs_r[:, None] * K + offs_k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    if SPLIT:
        tl.store(part_ptr + split.to(tl.int64) * part_split_stride + row * NR + offs_r, acc, mask=r_ok)
        if _last_split(counter_ptr + r_block, tl.num_programs(1)):
            acc = _sum_planes(part_ptr, row * NR + offs_r, r_ok, tl.num_programs(1), part_split_stride, PLANE_BLOCK)
            tl.store(h_ptr + row * NR + offs_r, acc, mask=r_ok)
    else:
        tl.store(h_ptr + row * NR + offs_r, acc, mask=r_ok)


@triton.jit
def _expand_row(y_ptr, h_ptr, b_ptr, rows_ptr, tiles_ptr, N, R, END0, END1, b_slot_stride, N_PER_PROGRAM,
                BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SLICES: tl.constexpr, PDL: tl.constexpr):
    await_previous_kernel(PDL)  # (first, as in _shrink_row)
    n_program = tl.program_id(0)
    slot, row = tl.load(tiles_ptr), tl.load(rows_ptr).to(tl.int64)  # (as in _shrink_row)
    if slot < 0:
        return
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    h_row = h_ptr + row * SLICES * R
    b_base = b_ptr + slot.to(tl.int64) * b_slot_stride
    n_first = n_program * N_PER_PROGRAM
    n_end = tl.minimum(n_first + N_PER_PROGRAM, N)
    for n0 in range(n_first, n_end, BLOCK_N):
        offs_n, n_ok, piece = _column_block(n0, n_end, END0, END1, BLOCK_N)
        y = tl.load(y_ptr + row * N + offs_n, mask=n_ok, other=0.0)  # (before B's loads, as in _expand_tile)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for i in tl.static_range(SLICES):
            h = tl.load(h_row + i * R + offs_r, mask=r_ok, other=0.0)
            w = tl.load(b_base + offs_n[:, None] * R + offs_r[None, :],
                        mask=(n_ok & (piece == i))[:, None] & r_ok[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * h[None, :], axis=1)
        tl.store(y_ptr + row * N + offs_n, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=n_ok)


def shrink_row(x: torch.Tensor, lora_a: torch.Tensor, rows: torch.Tensor, tiles: torch.Tensor, h: torch.Tensor,
               norm: torch.Tensor, prologue: int, eps: float, config: KernelConfig) -> None:
    """The shrink of a one-row step, on contiguous inputs the dispatcher has checked; ``norm`` is the
    RMSNorm's weight with prologue 1 (else any tensor: never read)."""
    _, nr, k = lora_a.shape
    sms, pdl = sm_count(x), pdl_launch(x, config.pdl)
    block_r = rank_block(nr)
    r_blocks = triton.cdiv(nr, block_r)
    splits, per_split = split_k(k, config.lora_row_block_k, r_blocks, sms, config)
    planes = planes_for(h, splits)
    counters = semaphore_counters(h.device, r_blocks) if splits > 1 else planes
    _shrink_row[(r_blocks, splits)](
        x, lora_a, h, planes, counters, rows, tiles, norm, eps, k, nr, per_split, x.stride(0), lora_a.stride(0),
        h.numel(), BLOCK_R=block_r, BLOCK_K=config.lora_row_block_k, NORM_BLOCK=min(pow2(k), config.lora_norm_block),
        PROLOGUE=prologue, SPLIT=splits > 1, PLANE_BLOCK=config.lora_merge_planes, **pdl)


def expand_row(y: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor, rows: torch.Tensor, tiles: torch.Tensor,
               slices: tuple[int, ...], config: KernelConfig) -> None:
    """The expand of a one-row step, on contiguous inputs the dispatcher has checked."""
    _, n, r = lora_b.shape
    sms, pdl = sm_count(y), pdl_launch(y, config.pdl)
    block_r2 = pow2(r, 16)
    block_n = max(64, min(256, 4096 // block_r2))
    per_program = column_runs(n, block_n, 1, sms, config)
    ends = slice_ends(slices, n)
    _expand_row[(triton.cdiv(n, per_program),)](
        y, h, lora_b, rows, tiles, n, r, ends[0], ends[1], lora_b.stride(0), per_program, BLOCK_N=block_n,
        BLOCK_R=block_r2, SLICES=len(slices), **pdl)
