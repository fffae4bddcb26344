"""Triton kernels of the ``lora`` op for decode steps (every sequence one token), the rows layout.

The shrink, at one row: a program per block of h's columns and split of K (about one per SM, so a
batch of one does not walk K on one SM); at several rows: tiles of up to 16 rows of one adapter
(program axis 0 is the slot; each program picks its rows from the step's slots), so each adapter's A
is read once per tile and not once per row, with K split so that the adapters in use still fill the
SMs. Each split writes its partial sums to a plane of its own (h itself when there is one split): no
zeroed buffer to fill first, no atomic add. Under the RMSNorm prologue a tile's rows are scaled by
1/rms after the sum (one number a row), so the squares are summed in the same pass, per split, and
the expand applies it. An expand program takes one row and a run of up to ``ROW_N_STEPS`` blocks of
output columns, loads every plane of its row at once and adds them (the program of the first run
also writes the sum to h). Rows on slot -1 return at once, and the runs keep the grid to a few
programs a row (one per 64 columns launched up to 28672 programs a row for Llama-3-8B's gate/up).
Both launch with programmatic dependent launch (``KernelConfig.pdl``).

The segments layout and the prologue's GEMM input are in ``lora_triton.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import KernelConfig
from .lora_triton import K_BLOCK, SEGMENT_ROWS, _gemm_input, slice_ends
from .triton_support import await_previous_kernel, dot_in_f32, pdl_launch, pow2, sm_count

ROW_K_BLOCK = 128     # in-features a decode shrink step reads
NORM_BLOCK = 2048     # in-features a decode shrink reads per step of the RMSNorm prologue's sum of squares
MAX_SPLITS = 64       # K splits of a decode shrink at most (the expand loads all their planes at once)
GROUPED_MIN_SPLIT_K = 256  # in-features of a split of a several-row decode shrink at least
ROW_N_STEPS = 4       # column blocks a decode expand program walks at most


@triton.jit
def _shrink_rows(x_ptr, a_ptr, out_ptr, slot_ptr, q_start_ptr, q_len_ptr, norm_ptr, eps, K, NR, K_PER_SPLIT, x_stride,
                 a_slot_stride, out_split_stride, out_stride, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                 NORM_BLOCK: tl.constexpr, PROLOGUE: tl.constexpr, PDL: tl.constexpr):
    # Every program waits first, before any early return, so that this kernel's end still implies
    # the previous kernel's (the next PDL kernel relies on it); PDL overlaps the launch itself.
    await_previous_kernel(PDL)
    b, r_block, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slot_ptr + b)
    if slot < 0 or tl.load(q_len_ptr + b) == 0:
        return
    row = tl.load(q_start_ptr + b).to(tl.int64)
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
    # Each split's partial sum goes to its own plane (one plane, h itself, without splits): no zeroed
    # buffer, no atomics; the expand adds the planes.
    tl.store(out_ptr + split.to(tl.int64) * out_split_stride + row * out_stride + offs_r, acc, mask=r_ok)


@triton.jit
def _shrink_grouped(x_ptr, a_ptr, out_ptr, sq_ptr, slot_ptr, q_start_ptr, q_len_ptr, norm_ptr, eps, K, NR, BATCH,
                    K_PER_SPLIT, x_stride, a_slot_stride, out_split_stride, out_stride, BLOCK_M: tl.constexpr,
                    BLOCK_B: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                    PROLOGUE: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):
    """A tile of up to BLOCK_M rows of one adapter (program axis 0: the slot; axis 1: which BLOCK_M of
    its rows), a block of h's columns and a split of K (axis 2: r_block * splits + split), as tl.dot
    tiles: the adapter's A is read once per tile of its rows, not once per row."""
    await_previous_kernel(PDL)  # (first, as in _shrink_rows)
    slot, m_tile, rs = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    splits = tl.num_programs(2) // tl.cdiv(NR, BLOCK_R)
    r_block, split = rs // splits, rs % splits
    offs_b = tl.arange(0, BLOCK_B)
    b_ok = offs_b < BATCH
    slots = tl.load(slot_ptr + offs_b, mask=b_ok, other=-1)
    mine = (slots == slot) & (tl.load(q_len_ptr + offs_b, mask=b_ok, other=0) > 0)
    rank = tl.cumsum(mine.to(tl.int32), axis=0) - 1
    if m_tile * BLOCK_M >= tl.sum(mine.to(tl.int32), axis=0):
        return
    # The tile's rows: the (m_tile * BLOCK_M + i)-th sequence on this slot, for each i.
    pick = mine[None, :] & (rank[None, :] == (m_tile * BLOCK_M + tl.arange(0, BLOCK_M))[:, None])
    m_ok = tl.sum(pick.to(tl.int32), axis=1) > 0
    b_of = tl.sum(tl.where(pick, offs_b[None, :], 0), axis=1)
    rows = tl.load(q_start_ptr + b_of, mask=m_ok, other=0).to(tl.int64)
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
    if PROLOGUE == 1 and not SPLIT:
        acc *= tl.rsqrt(squares / K + eps)[:, None]
    plane = out_ptr + split.to(tl.int64) * out_split_stride
    tl.store(plane + rows[:, None] * out_stride + offs_r[None, :], acc, mask=m_ok[:, None] & r_ok[None, :])
    if PROLOGUE == 1 and SPLIT:
        tl.store(sq_ptr + split.to(tl.int64) * BATCH + b_of, squares, mask=m_ok & (r_block == 0))


@triton.jit
def _expand_rows(y_ptr, h_ptr, part_ptr, sq_ptr, b_ptr, slot_ptr, q_start_ptr, q_len_ptr, N, R, END0, END1, SPLITS,
                 BATCH, K, eps, y_stride, h_stride, part_split_stride, b_slot_stride, N_PER_PROGRAM,
                 BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, SLICES: tl.constexpr,
                 SPLIT: tl.constexpr, SCALED: tl.constexpr, PDL: tl.constexpr):
    await_previous_kernel(PDL)  # (first, as in _shrink_rows)
    b, n_program = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slot_ptr + b)
    if slot < 0 or tl.load(q_len_ptr + b) == 0:
        return
    row = tl.load(q_start_ptr + b).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    b_base = b_ptr + slot.to(tl.int64) * b_slot_stride
    rstd = 1.0
    if SCALED:  # planes of an RMSNorm prologue's unscaled products: the splits' squares give 1/rms
        offs_s = tl.arange(0, BLOCK_S)
        squares = tl.load(sq_ptr + offs_s * BATCH + b, mask=offs_s < SPLITS, other=0.0)
        rstd = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    n_first = n_program * N_PER_PROGRAM
    n_end = tl.minimum(n_first + N_PER_PROGRAM, N)
    for n0 in range(n_first, n_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_end
        piece = (offs_n >= END0).to(tl.int32) + (offs_n >= END1).to(tl.int32)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for i in tl.static_range(SLICES):
            if SPLIT:  # the shrink's planes, all loaded at once: one round trip, not one per split
                offs_s = tl.arange(0, BLOCK_S)
                planes = tl.load(part_ptr + offs_s[:, None] * part_split_stride + row * h_stride + i * R
                                 + offs_r[None, :], mask=(offs_s < SPLITS)[:, None] & r_ok[None, :], other=0.0)
                h = tl.sum(planes, axis=0) * rstd
                if n_program == 0 and n0 == n_first:  # h is the op's output too: one program writes it
                    tl.store(h_ptr + row * h_stride + i * R + offs_r, h, mask=r_ok)
            else:
                h = tl.load(h_ptr + row * h_stride + i * R + offs_r, mask=r_ok, other=0.0)
            w = tl.load(b_base + offs_n[:, None] * R + offs_r[None, :],
                        mask=(n_ok & (piece == i))[:, None] & r_ok[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * h[None, :], axis=1)
        y = tl.load(y_ptr + row * y_stride + offs_n, mask=n_ok, other=0.0)
        tl.store(y_ptr + row * y_stride + offs_n, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=n_ok)


def launch_decode(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                  lora_slot: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor, h: torch.Tensor,
                  slices: tuple[int, ...], norm: torch.Tensor, prologue: int, eps: float, config: KernelConfig) -> None:
    """Shrink then expand for a step whose every sequence brings at most one token, on inputs the
    dispatcher has checked; ``norm`` as in ``launch_segments``."""
    batch, (_, nr, k), (_, n, r) = lora_slot.shape[0], lora_a.shape, lora_b.shape
    if batch == 0 or x.shape[0] == 0:
        return
    common, ends = (lora_slot, q_start, q_len), slice_ends(slices, n)
    sms = sm_count(x)
    pdl = pdl_launch(x, config.pdl)
    block_r = min(pow2(nr, 16), 64)
    squares = h  # (read only by an expand of split RMSNorm-prologue products)
    if batch == 1:
        # One row would leave most of the GPU idle while a program walks all of K: split K over
        # programs (about one per SM), each writing its partial sums to a plane of its own that the
        # expand adds.
        r_blocks, k_blocks = triton.cdiv(nr, block_r), triton.cdiv(k, ROW_K_BLOCK)
        splits = max(1, min(k_blocks, MAX_SPLITS, sms // r_blocks))
        per_split = triton.cdiv(k_blocks, splits) * ROW_K_BLOCK
        splits = triton.cdiv(k, per_split)
        planes = h if splits == 1 else torch.empty((splits, *h.shape), dtype=h.dtype, device=h.device)
        _shrink_rows[(batch, r_blocks, splits)](
            x, lora_a, planes, *common, norm, eps, k, nr, per_split, x.stride(0), lora_a.stride(0), h.numel(),
            h.stride(0), BLOCK_R=block_r, BLOCK_K=ROW_K_BLOCK, NORM_BLOCK=min(pow2(k), NORM_BLOCK),
            PROLOGUE=prologue, **pdl)
        scaled = False
    else:
        # Several rows: tiles of one adapter's rows (tl.dot), so each adapter's A is read once per
        # tile rather than once per row; K split so that the adapters in use still fill the SMs.
        slots = lora_a.shape[0]
        r_blocks, k_blocks = triton.cdiv(nr, block_r), triton.cdiv(k, GROUPED_MIN_SPLIT_K)
        splits = max(1, min(k_blocks, MAX_SPLITS, sms // (min(slots, batch) * r_blocks)))
        per_split = triton.cdiv(k_blocks, splits) * GROUPED_MIN_SPLIT_K
        splits = triton.cdiv(k, per_split)
        planes = h if splits == 1 else torch.empty((splits, *h.shape), dtype=h.dtype, device=h.device)
        scaled = prologue == 1 and splits > 1
        if scaled:
            squares = torch.empty((splits, batch), dtype=torch.float32, device=h.device)
        _shrink_grouped[(slots, triton.cdiv(batch, SEGMENT_ROWS), r_blocks * splits)](
            x, lora_a, planes, squares, *common, norm, eps, k, nr, batch, per_split, x.stride(0), lora_a.stride(0),
            h.numel(), h.stride(0), BLOCK_M=SEGMENT_ROWS, BLOCK_B=pow2(batch), BLOCK_R=block_r, BLOCK_K=K_BLOCK,
            SPLIT=splits > 1, PROLOGUE=prologue, DOT_F32=dot_in_f32(x.dtype), **pdl)
    # Output columns in runs of at most ROW_N_STEPS blocks: a program of a row without an adapter
    # returns at once, so the grid stays a few programs per row instead of one per block of columns.
    block_r2 = pow2(r, 16)
    block_n = max(64, min(256, 4096 // block_r2))
    n_blocks = triton.cdiv(n, block_n)
    programs = min(n_blocks, max(triton.cdiv(n_blocks, ROW_N_STEPS), triton.cdiv(2 * sms, batch)))
    per_program = triton.cdiv(n_blocks, programs) * block_n
    _expand_rows[(batch, triton.cdiv(n, per_program))](
        y, h, planes, squares, lora_b, *common, n, r, ends[0], ends[1], splits, batch, k, eps, y.stride(0),
        h.stride(0), h.numel(), lora_b.stride(0), per_program, BLOCK_N=block_n, BLOCK_R=block_r2,
        BLOCK_S=pow2(splits), SLICES=len(slices), SPLIT=splits > 1, SCALED=scaled, **pdl)
