"""Turning a ScheduleBatch into the step's index lists: token ids, positions, KV slots, the
per-sequence layout and page table rows, and which rows' logits are wanted. Plain Python lists;
the model runner makes them tensors."""

from __future__ import annotations

from dataclasses import dataclass

from .request import Request
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
    requests: list[Request]         # the request each logits row belongs to


def build_step_lists(batch: ScheduleBatch, page_size: int) -> StepLists:
    """The step's lists, rows in batch order: the decoding requests, then the chunks."""
    lists = _decode_lists(batch.decodes, page_size)
    for chunk in batch.chunks:
        _append_chunk(lists, chunk, page_size)
    return lists


def _decode_lists(requests: list[Request], page_size: int) -> StepLists:
    """The lists of decoding requests alone (one token each, their last, at position num_computed,
    wanting logits): row ``i`` is request ``i``. Every running request is one of these at every step,
    so they are built a column at a time, which CPython does ~2x faster than appending row by row."""
    positions = [r.num_computed for r in requests]
    page_rows = [r.pages for r in requests]
    rows = range(len(requests))
    return StepLists(
        token_ids=[(r.output_ids or r.prompt_ids)[-1] for r in requests],
        positions=positions,
        slots=[pages[pos // page_size] * page_size + pos % page_size for pages, pos in zip(page_rows, positions)],
        q_start=list(rows), q_len=[1] * len(requests), kv_len=[pos + 1 for pos in positions],
        page_rows=page_rows, logits_index=list(rows), requests=list(requests))


def _append_chunk(lists: StepLists, chunk: ScheduledChunk, page_size: int) -> None:
    """Appends any chunk's rows: a prefill chunk's tokens, or a single one."""
    request = chunk.request
    pages = request.pages
    start, end = chunk.start, chunk.end
    lists.q_start.append(len(lists.token_ids))
    lists.q_len.append(end - start)
    lists.kv_len.append(end)
    lists.page_rows.append(pages)
    lists.token_ids.extend(request.tokens(start, end))
    lists.positions.extend(range(start, end))
    lists.slots.extend(pages[pos // page_size] * page_size + pos % page_size for pos in range(start, end))
    if chunk.wants_logits:
        lists.logits_index.append(len(lists.token_ids) - 1)
        lists.requests.append(request)
