"""Triton kernels of the LoRA ops in tiles of the step's grouping (``lora_triton.py`` says the layouts).

Program axis 0 is a tile of ``lora_groups``: up to ``TILE_ROWS`` token rows of one adapter, so the
products are ``tl.dot`` tiles and the adapter's A (in the shrink) and B (in the expand) are read once
per tile, not once per row; tiles of slot -1 (past the step's tiles) return at once. The shrink
splits K so that the tiles in use still fill the SMs; the last split of a tile's block of h adds the
planes into h. Under the RMSNorm prologue a tile's rows are scaled by 1/rms after the sum (one number
a row), so the squares are summed in the same pass, per split, and the merge applies it. The expand
walks runs of output columns (axis 1).

At decode the data is small and the time is latency. Llama-3-8B, batch 64 over 8 adapters (8 rows
each, so 8 tiles in use of the 12 launched), rank 16, H100: the q/k/v shrink reads 3 MB of A and
0.5 MB of x (about 1 us at 3 TB/s) in a grid of 12 tiles x 16 splits of 256 in-features, one
program an SM; the down shrink (K = 14336) 12 x 28 splits of 512 (two an SM, ``split_k``). A program
is a chain of dependent round trips (a few hundred ns each): slot and rows, its split of x and A
(``lora_shrink_stages`` blocks in flight), its plane, the ticket (a fence and an atomic), and for the
last split the merge of the planes (``lora_merge_planes`` at a time) and h. The expand (q/k/v: 12 x
24 programs of 256 columns; gate/up: 12 x 56 of 512) reads 1.5-7 MB of B and reads and writes the
tile rows of y; each column block is one round trip once y's load overlaps B's. So each launch
should cost its launch and a handful of round trips (about 3-6 us), the gate/up expand its 14 MB.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.lora_layout import TILE_ROWS

from .config import KernelConfig
from .lora_groups import tile_count
from .lora_triton import (_column_block, _gemm_input, _last_split, _sum_planes, column_runs, planes_for, rank_block,
                          slice_ends, split_k)
from .triton_support import await_previous_kernel, dot_in_f32, pdl_launch, pow2, semaphore_counters, sm_count


@triton.jit
def _tile(rows_ptr, tiles_ptr, tile, TOKENS, BLOCK_M: tl.constexpr):
    """A tile's slot, its token rows (int64) and which of them are rows (the rest pad the tile). Both
    are loaded before the caller returns on slot -1: one round trip where loading the rows after the
    branch made two before the first load of x or B (a decode program's chain is a few round trips)."""
    slot = tl.load(tiles_ptr + tile)
    rows = tl.load(rows_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    return slot, rows.to(tl.int64), rows < TOKENS


@triton.jit
def _shrink_tile(x_ptr, a_ptr, h_ptr, part_ptr, sq_ptr, counter_ptr, rows_ptr, tiles_ptr, norm_ptr, eps, K, NR,
                 TOKENS, K_PER_SPLIT, x_stride, a_slot_stride, part_split_stride, BLOCK_M: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, PROLOGUE: tl.constexpr,
                 PLANE_BLOCK: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):
    """A tile (axis 0), a block of h's columns and a split of K (axis 1: r_block * splits + split);
    the squares of split s of block r_block in row ``r_block * splits + s`` of ``sq``."""
    # Every program waits first, before any early return, so that this kernel's end still implies
    # the previous kernel's (the next PDL kernel relies on it); PDL overlaps the launch itself.
    await_previous_kernel(PDL)
    tile, rs = tl.program_id(0), tl.program_id(1)
    splits = tl.num_programs(1) // tl.cdiv(NR, BLOCK_R)
    r_block, split = rs // splits, rs % splits
    slot, rows, m_ok = _tile(rows_ptr, tiles_ptr, tile, TOKENS, BLOCK_M)
    if slot < 0:
        return
    offs_r = r_block * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < NR
    a_base = a_ptr + slot.to(tl.int64) * a_slot_stride
    x_rows = x_ptr + rows[:, None] * x_stride
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    k_start = split * K_PER_SPLIT
    for k0 in range(k_start, tl.minimum(k_start + K_PER_SPLIT, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        mask = m_ok[:, None] & k_ok[None, :]
        if PROLOGUE == 1:
            # The norm's 1/rms is one number a row: it scales the row's product after the sum, so the
            # sum of squares is taken in the same pass (split K: each split's share, added by the
            # expand) instead of in a pass over the whole row first.
            v = tl.load(x_rows + offs_k[None, :], mask=mask, other=0.0)
            squares += tl.sum(v.to(tl.float32) * v.to(tl.float32), axis=1)
            g = tl.load(norm_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            x = (v.to(tl.float32) * g[None, :]).to(v.dtype)
        else:
            x = _gemm_input(x_rows + offs_k[None, :], mask, norm_ptr, k_ok[None, :], K, 0.0, PROLOGUE)
        a = tl.load(a_base + offs_r[None, :] * K + offs_k[:, None], mask=r_ok[None, :] & k_ok[:, None], other=0.0)
        if DOT_F32:
            x, a = x.to(tl.float32), a.to(tl.float32)
        acc += tl.dot(x, a)
    offsets, mask = rows[:, None] * NR + offs_r[None, :], m_ok[:, None] & r_ok[None, :]
    if SPLIT:
        tl.store(part_ptr + split.to(tl.int64) * part_split_stride + offsets, acc, mask=mask)
        if PROLOGUE == 1:
            tl.store(sq_ptr + rs.to(tl.int64) * TOKENS + rows, squares, mask=m_ok)
        if _last_split(counter_ptr + tile * tl.cdiv(NR, BLOCK_R) + r_block, splits):
            acc = _sum_planes(part_ptr, offsets, mask, splits, part_split_stride, PLANE_BLOCK)
            if PROLOGUE == 1:
                squares = _sum_planes(sq_ptr + (r_block * splits).to(tl.int64) * TOKENS, rows, m_ok, splits, TOKENS,
                                      PLANE_BLOCK)
                acc *= tl.rsqrt(squares / K + eps)[:, None]
            tl.store(h_ptr + offsets, acc, mask=mask)
    else:
        if PROLOGUE == 1:
            acc *= tl.rsqrt(squares / K + eps)[:, None]
        tl.store(h_ptr + offsets, acc, mask=mask)


@triton.jit
def _slice_product(h, b_base, offs_n, n_mask, offs_r, r_ok, R, DOT_F32: tl.constexpr):
    """h (a tile's rows of one slice) times that slice's B, for the columns ``n_mask`` keeps."""
    w = tl.load(b_base + offs_n[None, :] * R + offs_r[:, None], mask=n_mask[None, :] & r_ok[:, None], other=0.0)
    if DOT_F32:
        return tl.dot(h, w.to(tl.float32))
    return tl.dot(h.to(w.dtype), w)


@triton.jit
def _expand_tile(y_ptr, h_ptr, b_ptr, rows_ptr, tiles_ptr, N, R, END0, END1, TOKENS, b_slot_stride, N_PER_PROGRAM,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SLICES: tl.constexpr,
                 DOT_F32: tl.constexpr, PDL: tl.constexpr):
    """A tile (axis 0) and a run of output columns (axis 1)."""
    await_previous_kernel(PDL)  # (first, as in _shrink_tile)
    tile, n_program = tl.program_id(0), tl.program_id(1)
    slot, rows, m_ok = _tile(rows_ptr, tiles_ptr, tile, TOKENS, BLOCK_M)
    if slot < 0:
        return
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    # Each slice's h, loaded once for the whole run of columns (unrolled by hand: a loop over the
    # slices around the column walk made Triton 3.6's layout pass fail at three slices).
    h_ptrs, h_mask = h_ptr + rows[:, None] * (SLICES * R) + offs_r[None, :], m_ok[:, None] & r_ok[None, :]
    h0 = tl.load(h_ptrs, mask=h_mask, other=0.0)
    h1 = h0
    h2 = h0
    if SLICES > 1:
        h1 = tl.load(h_ptrs + R, mask=h_mask, other=0.0)
    if SLICES > 2:
        h2 = tl.load(h_ptrs + 2 * R, mask=h_mask, other=0.0)
    b_base = b_ptr + slot.to(tl.int64) * b_slot_stride
    n_first = n_program * N_PER_PROGRAM
    n_end = tl.minimum(n_first + N_PER_PROGRAM, N)
    for n0 in range(n_first, n_end, BLOCK_N):
        offs_n, n_ok, piece = _column_block(n0, n_end, END0, END1, BLOCK_N)
        y_ptrs = y_ptr + rows[:, None] * N + offs_n[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
        # y is loaded before B's products so that its round trip overlaps B's (loaded after them, it
        # was a second round trip a column block: the pipeliner only runs ahead the loads of tl.dot).
        y = tl.load(y_ptrs, mask=mask, other=0.0)
        acc = _slice_product(h0, b_base, offs_n, n_ok & (piece == 0), offs_r, r_ok, R, DOT_F32)
        if SLICES > 1:
            acc += _slice_product(h1, b_base, offs_n, n_ok & (piece == 1), offs_r, r_ok, R, DOT_F32)
        if SLICES > 2:
            acc += _slice_product(h2, b_base, offs_n, n_ok & (piece == 2), offs_r, r_ok, R, DOT_F32)
        tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def _busy_tiles(tokens: int, slots: int) -> int:
    """The tiles that hold rows: one an adapter in use at few rows, the rows' own at many."""
    return max(min(slots, tokens), triton.cdiv(tokens, TILE_ROWS))


def shrink_tiles(x: torch.Tensor, lora_a: torch.Tensor, rows: torch.Tensor, tiles: torch.Tensor, h: torch.Tensor,
                 norm: torch.Tensor, prologue: int, eps: float, config: KernelConfig) -> None:
    """The shrink over the step's tiles, on contiguous inputs the dispatcher has checked; ``norm`` as
    in ``lora_row_triton.shrink_row``."""
    tokens, (slots, nr, k) = x.shape[0], lora_a.shape
    sms, pdl = sm_count(x), pdl_launch(x, config.pdl)
    grid_tiles = tile_count(tokens, slots)
    block_r = rank_block(nr)
    r_blocks = triton.cdiv(nr, block_r)
    splits, per_split = split_k(k, config.lora_min_split_k, _busy_tiles(tokens, slots) * r_blocks, sms, config)
    planes = planes_for(h, splits)
    split = splits > 1
    # (read only with split K: the RMSNorm prologue's squares, and the merge's tickets)
    squares = torch.empty((r_blocks * splits, tokens), dtype=torch.float32, device=h.device) \
        if split and prologue == 1 else h
    counters = semaphore_counters(h.device, grid_tiles * r_blocks) if split else h
    _shrink_tile[(grid_tiles, r_blocks * splits)](
        x, lora_a, h, planes, squares, counters, rows, tiles, norm, eps, k, nr, tokens, per_split, x.stride(0),
        lora_a.stride(0), h.numel(), BLOCK_M=TILE_ROWS, BLOCK_R=block_r, BLOCK_K=config.lora_tile_block_k, SPLIT=split,
        PROLOGUE=prologue, PLANE_BLOCK=config.lora_merge_planes, DOT_F32=dot_in_f32(x.dtype),
        num_stages=config.lora_shrink_stages, **pdl)


def expand_tiles(y: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor, rows: torch.Tensor, tiles: torch.Tensor,
                 slices: tuple[int, ...], config: KernelConfig) -> None:
    """The expand over the step's tiles, on contiguous inputs the dispatcher has checked."""
    tokens, (slots, n, r) = y.shape[0], lora_b.shape
    sms, pdl = sm_count(y), pdl_launch(y, config.pdl)
    block_n = config.lora_tile_block_n
    per_program = column_runs(n, block_n, _busy_tiles(tokens, slots), sms, config)
    ends = slice_ends(slices, n)
    _expand_tile[(tile_count(tokens, slots), triton.cdiv(n, per_program))](
        y, h, lora_b, rows, tiles, n, r, ends[0], ends[1], tokens, lora_b.stride(0), per_program, BLOCK_M=TILE_ROWS,
        BLOCK_N=block_n, BLOCK_R=pow2(r, 16), SLICES=len(slices), DOT_F32=dot_in_f32(y.dtype), **pdl)
