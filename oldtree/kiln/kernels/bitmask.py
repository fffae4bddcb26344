"""Token bitmasks: their layout, allocation, and applying them to logits (torch on CPU, Triton on GPU).

A bitmask row packs the allowed tokens of one sequence into ``ceil(V / 32)`` int32 words, the layout
xgrammar fills: token t is allowed when bit ``t % 32`` of word ``t // 32`` is set. All bits set (-1)
allows every token. ``apply_bitmask`` sets the logits of disallowed tokens to -inf in place.

``rows`` selects which rows of the batch are constrained, indexing logits and bitmask alike, so
unconstrained rows of a mixed batch are not touched. A negative entry is skipped: a CUDA graph can
hold a fixed-size rows buffer and pad it with -1. The Triton launcher never reads device values on
the host, so it can be captured. Applying a mask is the runtime op ``apply_bitmask``
(``registry.impl_for_device``): the sampler calls it on a step's logits.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .config import DEFAULTS, KernelConfig
from .registry import register_impl
from .triton_support import require_device


BITS_PER_WORD = 32
ALL_ALLOWED = -1  # every bit of an int32 word set
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def bitmask_width(vocab_size: int) -> int:
    """Words per bitmask row: one bit per token of the logits width."""
    return math.ceil(vocab_size / BITS_PER_WORD)


def allocate_bitmask(batch: int, vocab_size: int, device: torch.device | str = "cpu", *,
                     pin_memory: bool = False) -> torch.Tensor:
    """An int32 ``[batch, ceil(V / 32)]`` bitmask allowing every token. xgrammar fills CPU rows;
    copy the filled mask to the logits' device before applying it there. A mask bound for a GPU
    should be pinned: only a copy from pinned memory is truly asynchronous, and a synchronous one
    waits for the step in flight, which the host should be overlapping instead."""
    return torch.full((batch, bitmask_width(vocab_size)), ALL_ALLOWED, dtype=torch.int32, device=device,
                      pin_memory=pin_memory)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The allowed tokens as bool ``[B, V]``."""
    shifts = torch.arange(BITS_PER_WORD, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    # Messages are formatted only on failure: this runs on every eager step.
    if logits.dim() != 2 or logits.dtype not in _FLOATS:
        raise ValueError(f"apply_bitmask: logits must be float [B, V], got {logits.dtype} {tuple(logits.shape)}")
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"apply_bitmask: bitmask must be int32 [B, W], got {bitmask.dtype} {tuple(bitmask.shape)}")
    width = bitmask_width(logits.shape[1])
    if bitmask.shape[1] != width:
        # A narrower mask would leave the last logits (padding rows of the vocabulary) unmasked.
        raise ValueError(f"apply_bitmask: bitmask has {bitmask.shape[1]} words a row; logits of width "
                         f"{logits.shape[1]} need {width}")
    if rows is None and bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"apply_bitmask: bitmask has {bitmask.shape[0]} rows, logits {logits.shape[0]}; "
                         "pass rows to mask a subset")
    if rows is not None and (rows.dtype not in (torch.int32, torch.int64) or rows.dim() != 1):
        raise ValueError(f"apply_bitmask: rows must be int32 or int64 [N], got {rows.dtype} {tuple(rows.shape)}")


def ref_apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """The plain-torch implementation (CPU, and the reference for the kernel)."""
    _check(logits, bitmask, rows)
    vocab_size = logits.shape[1]
    if rows is None:
        logits.masked_fill_(~unpack_bitmask(bitmask, vocab_size), -math.inf)
        return
    rows = rows[rows >= 0].long()
    if not bool((rows < min(logits.shape[0], bitmask.shape[0])).all()):
        raise ValueError(f"apply_bitmask: rows {rows.tolist()} index past logits ({logits.shape[0]}) or "
                         f"bitmask ({bitmask.shape[0]}) rows")
    selected = logits.index_select(0, rows)
    selected.masked_fill_(~unpack_bitmask(bitmask.index_select(0, rows), vocab_size), -math.inf)
    logits.index_copy_(0, rows, selected)


@triton.jit
def _apply_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, vocab_size, num_words, logits_row_stride,
                          bitmask_row_stride, HAS_ROWS: tl.constexpr, WORDS: tl.constexpr):
    # Program (i, j) masks tokens [j * WORDS * 32, (j + 1) * WORDS * 32) of row rows[i] (or of row i).
    # Logits are only written, never read: a masked store puts -inf where a bit is clear.
    if HAS_ROWS:
        row = tl.load(rows_ptr + tl.program_id(0)).to(tl.int64)
    else:
        row = tl.program_id(0).to(tl.int64)
    live = row >= 0  # -1 pads a fixed-size rows buffer
    words_at = tl.program_id(1) * WORDS + tl.arange(0, WORDS)
    words = tl.load(bitmask_ptr + row * bitmask_row_stride + words_at, mask=live & (words_at < num_words),
                    other=-1)
    bit = tl.arange(0, 32)
    allowed = ((words[:, None] >> bit[None, :]) & 1) != 0
    tokens = words_at[:, None] * 32 + bit[None, :]
    disallowed = live & (tokens < vocab_size) & ~allowed
    tl.store(logits_ptr + row * logits_row_stride + tokens, float("-inf"), mask=disallowed)


def triton_apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None, *,
                         config: KernelConfig = DEFAULTS) -> None:
    """The Triton kernel's launcher. ``rows`` values are trusted (checking them would sync the GPU).
    A program masks ``config.bitmask_words_per_program`` words (32 tokens each) of a row: at 256 x
    151936 f32 logits it writes as fast as xgrammar's load-and-store kernel on a mask allowing almost
    nothing, and beats it on one allowing almost everything, as inside a JSON string."""
    _check(logits, bitmask, rows)
    require_device("apply_bitmask", *(t for t in (logits, bitmask, rows) if t is not None))
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("apply_bitmask: logits and bitmask rows must be contiguous")
    num_rows = logits.shape[0] if rows is None else rows.shape[0]
    num_words = bitmask.shape[1]
    if num_rows == 0:
        return
    words_per_program = config.bitmask_words_per_program
    grid = (num_rows, triton.cdiv(num_words, words_per_program))
    _apply_bitmask_kernel[grid](logits, bitmask, rows if rows is not None else bitmask, logits.shape[1], num_words,
                                logits.stride(0), bitmask.stride(0), HAS_ROWS=rows is not None,
                                WORDS=words_per_program)


register_impl("apply_bitmask", "torch", ref_apply_bitmask)
register_impl("apply_bitmask", "triton", triton_apply_bitmask, priority=10, wants_config=True)
