"""Turning a ScheduleBatch into the step's index lists: token ids, positions, KV slots, the
per-sequence layout and page table rows, and which rows' logits are wanted. Plain Python lists;
the model runner makes them tensors."""

from __future__ import annotations

from dataclasses import dataclass

from .scheduler import ScheduleBatch, ScheduledChunk


@dataclass(frozen=True)
class StepLists:
    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    q_start: list[int]
    q_len: list[int]
    kv_len: list[int]
    page_rows: list[list[int]]      # one page-table row per sequence (ragged)
    logits_index: list[int]         # token rows whose logits are sampled
    sampled: list[ScheduledChunk]   # the chunk each logits row belongs to


def build_step_lists(batch: ScheduleBatch, page_size: int) -> StepLists:
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    q_start: list[int] = []
    q_len: list[int] = []
    kv_len: list[int] = []
    page_rows: list[list[int]] = []
    logits_index: list[int] = []
    sampled: list[ScheduledChunk] = []
    for chunk in batch.chunks:
        request = chunk.request
        pages = request.pages
        start, end = chunk.start, chunk.end
        q_start.append(len(token_ids))
        q_len.append(end - start)
        kv_len.append(end)
        page_rows.append(pages)
        if end - start == 1:
            # A decode step's one token, the common case at every step of every running request.
            token_ids.append(request.token_at(start))
            positions.append(start)
            slots.append(pages[start // page_size] * page_size + start % page_size)
        else:
            token_ids.extend(request.tokens(start, end))
            for pos in range(start, end):
                positions.append(pos)
                slots.append(pages[pos // page_size] * page_size + pos % page_size)
        if chunk.wants_logits:
            logits_index.append(len(token_ids) - 1)
            sampled.append(chunk)
    return StepLists(token_ids, positions, slots, q_start, q_len, kv_len, page_rows, logits_index, sampled)
