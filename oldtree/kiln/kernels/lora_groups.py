"""The ``lora_groups`` op (``kiln/ir/ops_lora.py``): a step's token rows grouped by adapter slot, once a step.

Every LoRA hook of a step multiplies the same rows by the same adapters, so the grouping is made
once, at the top of the step, and each hook's kernels only read their tile: ``lora_rows[i]`` (the
``TILE_ROWS`` token rows of tile i, padded with ``T``) and ``lora_tiles[i]`` (its slot, -1: no
tile). The layout is ``moe_align``'s (rows for pairs, slots for experts): each slot's rows in token
order, padded to whole tiles, the slots in order. Only the first ``tile_count(T, L)`` tiles are
written and read: a slot's run wastes less than a tile, and every tile holds a row.

The Triton version is two small launches with fixed shapes, so a captured step replays it: each
token row's slot (``_token_slots``, a program per block of rows), then ``triton_moe_align``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.lora_layout import TILE_ROWS

from .moe_align import triton_moe_align
from .registry import register_impl
from .triton_support import pow2, require, require_device, require_index

TOKEN_BLOCK = 128  # token rows a _token_slots program labels
SEQUENCE_BLOCK = 64  # sequences it compares them with at a time


def tile_count(tokens: int, slots: int) -> int:
    """The tiles a step of ``tokens`` rows over ``slots`` slots may need: at most one a row, and at
    most a partial tile a slot beyond the rows' whole tiles."""
    return min(tokens, triton.cdiv(tokens + slots * (TILE_ROWS - 1), TILE_ROWS))


def token_slots(tokens: int, lora_slot: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor) -> torch.Tensor:
    """Each token row's adapter slot: its sequence's, or -1 (a base-model or padding row)."""
    rows = torch.arange(tokens, device=lora_slot.device)[:, None]
    inside = (rows >= q_start[None, :]) & (rows < (q_start + q_len)[None, :])
    return torch.where(inside, lora_slot[None, :].to(torch.int64), -1).amax(dim=1) if q_start.numel() else \
        torch.full((tokens,), -1, dtype=torch.int64, device=lora_slot.device)


def ref_lora_groups(lora_slot: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor, tokens: int,
                    slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(lora_rows [T, TILE_ROWS], lora_tiles [T]), every entry written (past the tiles: T and -1).
    Torch ops only, no value read on the host: a captured step can replay it."""
    device = lora_slot.device
    ids = token_slots(tokens, lora_slot, q_start, q_len)
    mine = (ids[:, None] == torch.arange(slots, device=device)[None, :]).to(torch.int64)  # [T, L]
    padded = (mine.sum(dim=0) + TILE_ROWS - 1) // TILE_ROWS * TILE_ROWS
    ends = torch.cumsum(padded, dim=0)
    earlier_of_slot = torch.cumsum(mine, dim=0) - mine
    entry = (mine * ((ends - padded)[None, :] + earlier_of_slot)).sum(dim=1)
    flat = torch.full((tokens * TILE_ROWS + 1,), tokens, dtype=torch.int32, device=device)
    dump = tokens * TILE_ROWS  # rows of no slot are placed here, then dropped
    flat[torch.where(ids >= 0, entry, dump)] = torch.arange(tokens, dtype=torch.int32, device=device)
    first_entries = torch.arange(tokens, device=device) * TILE_ROWS
    before = (ends[None, :] <= first_entries[:, None]).sum(dim=1)
    tiles = torch.where(before < slots, before, -1).to(torch.int32)
    return flat[:dump].reshape(tokens, TILE_ROWS), tiles


def grouped_slots(lora_rows: torch.Tensor, lora_tiles: torch.Tensor, slots: int) -> torch.Tensor:
    """Each token row's slot as the grouping says (-1: in no tile): what the hooks' references read."""
    tokens = lora_rows.shape[0]
    used = tile_count(tokens, slots)
    rows = lora_rows[:used].reshape(-1).to(torch.int64)
    of_row = lora_tiles[:used].to(torch.int64).repeat_interleave(TILE_ROWS)
    result = torch.full((tokens + 1,), -1, dtype=torch.int64, device=lora_rows.device)
    result[torch.where(rows < tokens, rows, tokens)] = torch.where(rows < tokens, of_row, -1)
    return result[:tokens]


@triton.jit
def _token_slots(slot_ptr, q_start_ptr, q_len_ptr, out_ptr, TOKENS, BATCH, BLOCK_T: tl.constexpr,
                 BLOCK_B: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.full((BLOCK_T,), -1, dtype=tl.int32)
    for b0 in range(0, BATCH, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        b_ok = offs_b < BATCH
        start = tl.load(q_start_ptr + offs_b, mask=b_ok, other=0)
        end = start + tl.load(q_len_ptr + offs_b, mask=b_ok, other=0)
        of_b = tl.load(slot_ptr + offs_b, mask=b_ok, other=-1).to(tl.int32)
        inside = (offs_t[:, None] >= start[None, :]) & (offs_t[:, None] < end[None, :])
        slot = tl.maximum(slot, tl.max(tl.where(inside, of_b[None, :], -1), axis=1))
    tl.store(out_ptr + offs_t, slot, mask=offs_t < TOKENS)


def triton_lora_groups(lora_slot: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor, *,
                       out: tuple[torch.Tensor, torch.Tensor], slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes the first ``tile_count`` tiles of ``out`` (lora_rows, lora_tiles)."""
    rows, tiles = out
    require_device("lora_groups", lora_slot, q_start, q_len, rows, tiles)
    for name, t in (("lora_slot", lora_slot), ("q_start", q_start), ("q_len", q_len)):
        require_index("lora_groups", name, t)
    require(rows.is_contiguous() and tiles.is_contiguous(), "lora_groups",
            lambda: "lora_rows and lora_tiles must be contiguous")
    tokens, batch = rows.shape[0], lora_slot.shape[0]
    if tokens == 0:
        return out
    ids = torch.empty(tokens, dtype=torch.int32, device=rows.device)
    _token_slots[(triton.cdiv(tokens, TOKEN_BLOCK),)](
        lora_slot, q_start, q_len, ids, tokens, batch, BLOCK_T=TOKEN_BLOCK,
        BLOCK_B=min(pow2(batch), SEQUENCE_BLOCK))
    used = tile_count(tokens, slots)
    triton_moe_align(ids, slots, TILE_ROWS, out=(rows.view(-1)[:used * TILE_ROWS], tiles[:used]))
    return out


def _torch_lora_groups(lora_slot, q_start, q_len, *, out, slots):
    rows, tiles = out
    made = ref_lora_groups(lora_slot, q_start, q_len, rows.shape[0], slots)
    rows.copy_(made[0])
    tiles.copy_(made[1])
    return out


register_impl("lora_groups", "torch", _torch_lora_groups)
register_impl("lora_groups", "triton", triton_lora_groups, priority=10)
