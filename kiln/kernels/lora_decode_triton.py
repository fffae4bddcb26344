"""Triton kernels of the ``lora`` op for decode steps (every sequence one token), the rows layout.

The shrink, at one row: a program per block of h's columns and split of K (about one per SM, so a
batch of one does not walk K on one SM); at several rows: tiles of up to 16 rows of one adapter
(program axis 0 is the slot; each program picks its rows from the step's slots), so each adapter's A
is read once per tile and not once per row, with K split so that the adapters in use still fill the
SMs. Each split writes its partial sums to a plane of its own (h itself when there is one split): no
zeroed buffer to fill first, no atomic add. Under the RMSNorm prologue a tile's rows are scaled by
1/rms after the sum (one number a row), so the squares are summed in the same pass, per split, and
the expand applies it. The expand, at one row: a program per run of up to ``ROW_N_STEPS`` blocks of
output columns, loading every plane of its row at once; at several rows: the same adapter tiles
(tl.dot), so B too is read once per tile. The programs of the first run also write the summed h.
Programs without rows (slot -1, empty slots, tiles past a slot's rows) return at once, and the runs
keep the grid to a few programs a row or tile (one per 64 columns launched up to 28672 programs a
row for Llama-3-8B's gate/up). All launch with programmatic dependent launch (``KernelConfig.pdl``).

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
GROUPED_N_BLOCK = 128  # output columns a several-row decode expand step writes
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
def _rows_on(slot_ptr, q_len_ptr, slot, BATCH, BLOCK_B: tl.constexpr):
    """How many of the step's sequences (one row each) are on ``slot``."""
    offs_b = tl.arange(0, BLOCK_B)
    b_ok = offs_b < BATCH
    mine = (tl.load(slot_ptr + offs_b, mask=b_ok, other=-1) == slot) & \
        (tl.load(q_len_ptr + offs_b, mask=b_ok, other=0) > 0)
    return tl.sum(mine.to(tl.int32), axis=0)


@triton.jit
def _adapter_tile(slot_ptr, q_start_ptr, q_len_ptr, slot, m_tile, BATCH, BLOCK_M: tl.constexpr,
                  BLOCK_B: tl.constexpr):
    """Tile ``m_tile`` of the rows on ``slot``: its i-th row is the (m_tile * BLOCK_M + i)-th sequence
    on the slot, in batch order. (which rows are real, their sequences, their token rows)."""
    offs_b = tl.arange(0, BLOCK_B)
    b_ok = offs_b < BATCH
    mine = (tl.load(slot_ptr + offs_b, mask=b_ok, other=-1) == slot) & \
        (tl.load(q_len_ptr + offs_b, mask=b_ok, other=0) > 0)
    rank = tl.cumsum(mine.to(tl.int32), axis=0) - 1
    pick = mine[None, :] & (rank[None, :] == (m_tile * BLOCK_M + tl.arange(0, BLOCK_M))[:, None])
    m_ok = tl.sum(pick.to(tl.int32), axis=1) > 0
    b_of = tl.sum(tl.where(pick, offs_b[None, :], 0), axis=1)
    rows = tl.load(q_start_ptr + b_of, mask=m_ok, other=0).to(tl.int64)
    return m_ok, b_of, rows


@triton.jit
def _tile_h(h_ptr, part_ptr, rows, m_ok, col, R, SPLITS, part_split_stride, h_stride, rstd, WRITE,
            BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, SPLIT: tl.constexpr):
    """One slice's h for a tile's rows (columns ``col .. col + R``): the sum of the shrink's planes
    (times 1/rms), written to h by the programs with ``WRITE``; or h itself without splits."""
    offs_r = tl.arange(0, BLOCK_R)
    ptrs = rows[:, None] * h_stride + col + offs_r[None, :]
    mask = m_ok[:, None] & (offs_r < R)[None, :]
    if SPLIT:
        h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        # Unrolled over the planes' power-of-two bound: a runtime loop here, inlined once per slice,
        # made Triton 3.6's layout pass fail at three slices ("operand does not dominate this use").
        for s in tl.static_range(BLOCK_S):
            h += tl.load(part_ptr + s * part_split_stride + ptrs, mask=mask & (s < SPLITS), other=0.0)
        h = h * rstd[:, None]
        tl.store(h_ptr + ptrs, h, mask=mask & WRITE)
    else:
        h = tl.load(h_ptr + ptrs, mask=mask, other=0.0)
    return h


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
    if m_tile * BLOCK_M >= _rows_on(slot_ptr, q_len_ptr, slot, BATCH, BLOCK_B):
        return
    m_ok, b_of, rows = _adapter_tile(slot_ptr, q_start_ptr, q_len_ptr, slot, m_tile, BATCH, BLOCK_M, BLOCK_B)
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


@triton.jit
def _slice_product(h, b_base, offs_n, n_mask, offs_r, r_ok, R, DOT_F32: tl.constexpr):
    """h (a tile's rows of one slice) times that slice's B, for the columns ``n_mask`` keeps."""
    w = tl.load(b_base + offs_n[None, :] * R + offs_r[:, None], mask=n_mask[None, :] & r_ok[:, None], other=0.0)
    if DOT_F32:
        return tl.dot(h, w.to(tl.float32))
    return tl.dot(h.to(w.dtype), w)


@triton.jit
def _expand_grouped(y_ptr, h_ptr, part_ptr, sq_ptr, b_ptr, slot_ptr, q_start_ptr, q_len_ptr, N, R, END0, END1, SPLITS,
                    BATCH, K, eps, y_stride, h_stride, part_split_stride, b_slot_stride, N_PER_PROGRAM,
                    BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_S: tl.constexpr, SLICES: tl.constexpr, SPLIT: tl.constexpr, SCALED: tl.constexpr,
                    DOT_F32: tl.constexpr, PDL: tl.constexpr):
    """A tile of up to BLOCK_M rows of one adapter (axes 0 and 1 as in _shrink_grouped) and a run of
    output columns (axis 2), as tl.dot tiles: the adapter's B is read once per tile, not once per row."""
    await_previous_kernel(PDL)  # (first, as in _shrink_rows)
    slot, m_tile, n_program = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if m_tile * BLOCK_M >= _rows_on(slot_ptr, q_len_ptr, slot, BATCH, BLOCK_B):
        return
    m_ok, b_of, rows = _adapter_tile(slot_ptr, q_start_ptr, q_len_ptr, slot, m_tile, BATCH, BLOCK_M, BLOCK_B)
    rstd = tl.full((BLOCK_M,), 1.0, dtype=tl.float32)
    if SCALED:  # planes of an RMSNorm prologue's unscaled products: the splits' squares give 1/rms
        offs_s = tl.arange(0, BLOCK_S)
        squares = tl.load(sq_ptr + offs_s[:, None] * BATCH + b_of[None, :],
                          mask=(offs_s < SPLITS)[:, None] & m_ok[None, :], other=0.0)
        rstd = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    write = n_program == 0
    h0 = _tile_h(h_ptr, part_ptr, rows, m_ok, 0, R, SPLITS, part_split_stride, h_stride, rstd, write, BLOCK_M,
                 BLOCK_R, BLOCK_S, SPLIT)
    h1 = h0
    h2 = h0
    if SLICES > 1:
        h1 = _tile_h(h_ptr, part_ptr, rows, m_ok, R, R, SPLITS, part_split_stride, h_stride, rstd, write, BLOCK_M,
                     BLOCK_R, BLOCK_S, SPLIT)
    if SLICES > 2:
        h2 = _tile_h(h_ptr, part_ptr, rows, m_ok, 2 * R, R, SPLITS, part_split_stride, h_stride, rstd, write,
                     BLOCK_M, BLOCK_R, BLOCK_S, SPLIT)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    b_base = b_ptr + slot.to(tl.int64) * b_slot_stride
    n_first = n_program * N_PER_PROGRAM
    n_end = tl.minimum(n_first + N_PER_PROGRAM, N)
    for n0 in range(n_first, n_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_end
        piece = (offs_n >= END0).to(tl.int32) + (offs_n >= END1).to(tl.int32)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc += _slice_product(h0, b_base, offs_n, n_ok & (piece == 0), offs_r, r_ok, R, DOT_F32)
        if SLICES > 1:
            acc += _slice_product(h1, b_base, offs_n, n_ok & (piece == 1), offs_r, r_ok, R, DOT_F32)
        if SLICES > 2:
            acc += _slice_product(h2, b_base, offs_n, n_ok & (piece == 2), offs_r, r_ok, R, DOT_F32)
        y_ptrs = y_ptr + rows[:, None] * y_stride + offs_n[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


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
    # Output columns in runs of at most ROW_N_STEPS blocks: programs without rows return at once, so
    # the grid stays a few programs a row (or a tile) instead of one per block of columns.
    block_r2 = pow2(r, 16)
    common_args = (y, h, planes, squares, lora_b, *common, n, r, ends[0], ends[1], splits, batch, k, eps, y.stride(0),
                   h.stride(0), h.numel(), lora_b.stride(0))
    if batch == 1:
        block_n = max(64, min(256, 4096 // block_r2))
        n_blocks = triton.cdiv(n, block_n)
        programs = min(n_blocks, max(triton.cdiv(n_blocks, ROW_N_STEPS), 2 * sms))
        per_program = triton.cdiv(n_blocks, programs) * block_n
        _expand_rows[(batch, triton.cdiv(n, per_program))](
            *common_args, per_program, BLOCK_N=block_n, BLOCK_R=block_r2, BLOCK_S=pow2(splits), SLICES=len(slices),
            SPLIT=splits > 1, SCALED=scaled, **pdl)
        return
    slots = lora_a.shape[0]
    block_n = GROUPED_N_BLOCK
    n_blocks = triton.cdiv(n, block_n)
    programs = min(n_blocks, max(triton.cdiv(n_blocks, ROW_N_STEPS), triton.cdiv(2 * sms, min(slots, batch))))
    per_program = triton.cdiv(n_blocks, programs) * block_n
    _expand_grouped[(slots, triton.cdiv(batch, SEGMENT_ROWS), triton.cdiv(n, per_program))](
        *common_args, per_program, BLOCK_M=SEGMENT_ROWS, BLOCK_B=pow2(batch), BLOCK_N=block_n, BLOCK_R=block_r2,
        BLOCK_S=pow2(splits), SLICES=len(slices), SPLIT=splits > 1, SCALED=scaled, DOT_F32=dot_in_f32(x.dtype),
        **pdl)
