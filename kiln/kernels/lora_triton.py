"""Triton kernels of the ``lora`` op: shrink (``h = x @ A[s].T``) then expand (``y += h @ B[s].T`` per slice).

Two layouts of the same two steps:
- segments (SGMV, prefill and mixed steps): a program takes a block of one sequence's token rows,
  so the rows of a tile share one adapter and the products are ``tl.dot`` tiles. The first grid axis
  is sized for the longest sequence (``max_q_len``, else ``T``); blocks past a sequence's length,
  and sequences on slot -1 (the base model) or without tokens, return at once.
- rows (decode steps, every sequence one token): ``lora_decode_triton.py``.

The expand reads slice ``i``'s rows of h (``i*R .. i*R + R``) for the columns of y in slice ``i``
(up to three slices: fused q/k/v); it adds in f32 and rounds once into y. Under the interpreter
(and for f32) the products are f32, as ``dot_in_f32`` says.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_support import dot_in_f32, pow2

# What x is (the op's ``prologue``): the GEMM input itself, an RMSNorm's input (normalized and scaled
# here, rounded as the unfused norm rounds), or the gate/up GEMM's output (silu(gate) * up made here).
PROLOGUE_CODES = {"none": 0, "rmsnorm": 1, "silu_mul": 2}
SEGMENT_ROWS = 16     # token rows of a segment tile (tl.dot's least)
K_BLOCK = 64          # in-features a shrink step reads
N_BLOCK = 64          # output columns of an expand program


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
def _shrink_segments(x_ptr, a_ptr, h_ptr, slot_ptr, q_start_ptr, q_len_ptr, norm_ptr, eps, K, NR, x_stride,
                     a_slot_stride, h_stride, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                     DOT_F32: tl.constexpr, PROLOGUE: tl.constexpr):
    m_block, b, r_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slot_ptr + b)
    length = tl.load(q_len_ptr + b)
    if slot < 0 or m_block * BLOCK_M >= length:
        return
    start = tl.load(q_start_ptr + b).to(tl.int64)
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = r_block * BLOCK_R + tl.arange(0, BLOCK_R)
    m_ok, r_ok = offs_m < length, offs_r < NR
    a_base = a_ptr + slot.to(tl.int64) * a_slot_stride
    x_rows = x_ptr + (start + offs_m)[:, None] * x_stride
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if PROLOGUE == 1:
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            v = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & (offs_k < K)[None, :], other=0.0).to(tl.float32)
            rstd += tl.sum(v * v, axis=1)
        rstd = tl.rsqrt(rstd / K + eps)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = _gemm_input(x_rows + offs_k[None, :], m_ok[:, None] & k_ok[None, :], norm_ptr + offs_k[None, :],
                        k_ok[None, :], K, rstd[:, None], PROLOGUE)
        a = tl.load(a_base + offs_r[None, :] * K + offs_k[:, None], mask=r_ok[None, :] & k_ok[:, None], other=0.0)
        if DOT_F32:
            x, a = x.to(tl.float32), a.to(tl.float32)
        acc += tl.dot(x, a)
    tl.store(h_ptr + (start + offs_m)[:, None] * h_stride + offs_r[None, :], acc, mask=m_ok[:, None] & r_ok[None, :])


@triton.jit
def _expand_segments(y_ptr, h_ptr, b_ptr, slot_ptr, q_start_ptr, q_len_ptr, N, R, END0, END1, y_stride, h_stride,
                     b_slot_stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                     SLICES: tl.constexpr, DOT_F32: tl.constexpr):
    m_block, b, n_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slot_ptr + b)
    length = tl.load(q_len_ptr + b)
    if slot < 0 or m_block * BLOCK_M >= length:
        return
    start = tl.load(q_start_ptr + b).to(tl.int64)
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    m_ok, n_ok, r_ok = offs_m < length, offs_n < N, offs_r < R
    piece = (offs_n >= END0).to(tl.int32) + (offs_n >= END1).to(tl.int32)  # each column's slice
    b_base = b_ptr + slot.to(tl.int64) * b_slot_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in tl.static_range(SLICES):
        h = tl.load(h_ptr + (start + offs_m)[:, None] * h_stride + i * R + offs_r[None, :],
                    mask=m_ok[:, None] & r_ok[None, :], other=0.0)
        w = tl.load(b_base + offs_n[None, :] * R + offs_r[:, None],
                    mask=(n_ok & (piece == i))[None, :] & r_ok[:, None], other=0.0)
        if DOT_F32:
            acc += tl.dot(h, w.to(tl.float32))
        else:
            acc += tl.dot(h.to(w.dtype), w)
    y_ptrs = y_ptr + (start + offs_m)[:, None] * y_stride + offs_n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def slice_ends(slices: tuple[int, ...], n: int) -> list[int]:
    """Where slices 0 and 1 end among y's n columns (n past the last slice): a column's slice is how
    many of the two it is at or past."""
    return [sum(slices[:i + 1]) for i in range(len(slices) - 1)] + [n] * (3 - len(slices))


def launch_segments(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    lora_slot: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor, h: torch.Tensor,
                    slices: tuple[int, ...], max_q_len: int, norm: torch.Tensor, prologue: int, eps: float) -> None:
    """Shrink then expand, on inputs the dispatcher has checked; ``max_q_len`` bounds every q_len;
    ``norm`` is the RMSNorm's weight with prologue 1 (else any tensor: never read)."""
    batch, (_, nr, k), (_, n, r) = lora_slot.shape[0], lora_a.shape, lora_b.shape
    if batch == 0 or max_q_len == 0 or x.shape[0] == 0:
        return
    ends = slice_ends(slices, n)
    block_r = min(pow2(nr, 16), 64)
    common = (lora_slot, q_start, q_len)
    m_blocks = triton.cdiv(max_q_len, SEGMENT_ROWS)
    dot_f32 = dot_in_f32(x.dtype)
    _shrink_segments[(m_blocks, batch, triton.cdiv(nr, block_r))](
        x, lora_a, h, *common, norm, eps, k, nr, x.stride(0), lora_a.stride(0), h.stride(0), BLOCK_M=SEGMENT_ROWS,
        BLOCK_R=block_r, BLOCK_K=K_BLOCK, DOT_F32=dot_f32, PROLOGUE=prologue)
    _expand_segments[(m_blocks, batch, triton.cdiv(n, N_BLOCK))](
        y, h, lora_b, *common, n, r, ends[0], ends[1], y.stride(0), h.stride(0), lora_b.stride(0),
        BLOCK_M=SEGMENT_ROWS, BLOCK_N=N_BLOCK, BLOCK_R=pow2(r, 16), SLICES=len(slices), DOT_F32=dot_f32)
