"""Turning a ScheduleBatch into the step's index lists: token ids, positions, KV slots, the
per-sequence layout and page table rows, and which rows' logits are wanted. Plain Python lists, a
column per step-schema field (``kiln.step_schema``); the model runner makes them tensors."""

from __future__ import annotations

from kiln.step_schema import STEP_SCHEMA, StepSchema

from ..spec.tree import DraftTree, tree_mask_rows
from .request import Request
from .scheduler import ScheduleBatch, ScheduledChunk, prompt_logprob_positions


class StepLists:
    """One step's inputs as host lists: ``lists.<field>`` for each step-schema field the scheduler
    fills (a 2-D field, the page table, as ragged rows), and ``requests``, the request each logits
    row belongs to. Rows past those, ``prompt_rows``, score prompt tokens for requests that asked
    for prompt logprobs: ``(request, position)`` whose logits give token ``position + 1``'s logprob. A field left out is padding throughout (its schema padding value): a feature's
    input only the steps that use it fill. (Columns are plain attributes: the decode path reads
    them every step.)"""

    def __init__(self, requests: list[Request] | None = None, **columns: list) -> None:
        self.requests: list[Request] = requests if requests is not None else []
        self.prompt_rows: list[tuple[Request, int]] = []
        self.__dict__.update(columns)

    @staticmethod
    def empty(schema: StepSchema = STEP_SCHEMA) -> "StepLists":
        return StepLists([], **{name: [] for name in schema.names})

    def column(self, name: str) -> list | None:
        """A field's column, or None when the step leaves it as padding."""
        return self.__dict__.get(name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StepLists) and self.__dict__ == other.__dict__

    def __repr__(self) -> str:
        columns = {k: v for k, v in self.__dict__.items() if k not in ("requests", "prompt_rows")}
        return f"StepLists({columns}, requests={len(self.requests)})"


def build_step_lists(batch: ScheduleBatch, page_size: int) -> StepLists:
    """The step's lists, rows in batch order: the decoding requests, then the chunks."""
    lists = _decode_lists(batch.decodes, page_size)
    prompt_rows: list[int] = []
    for chunk in batch.chunks:
        _append_chunk(lists, chunk, page_size)
        positions = prompt_logprob_positions(chunk)
        if positions:
            first_row = len(lists.token_ids) - (chunk.end - chunk.start)
            prompt_rows.extend(first_row + p - chunk.start for p in positions)
            lists.prompt_rows.extend((chunk.request, p) for p in positions)
    # The sampled rows first (the sampler reads rows 0..len(requests)), then the prompt-scoring ones.
    lists.logits_index.extend(prompt_rows)
    return lists


def build_verify_lists(batch: ScheduleBatch, trees: list[DraftTree], page_size: int,
                       tree_masks: bool = False) -> StepLists:
    """A verify step's lists: decoding request ``i`` brings its last token and the nodes of
    ``trees[i]`` (whose pages ``Scheduler.reserve_drafts`` gave it), side by side in its context,
    each at the position of its depth, and wants the logits of each, one row per token in
    ``requests``; then the chunks, as in ``build_step_lists``. ``tree_masks``: the artifact reads a
    tree mask (``spec/tree.py``), filled for every token (-1, plain causal, but in a tree)."""
    lists = StepLists.empty()
    lists.lora_slot = []  # (a column of LoRA artifacts' schema: every step fills it)
    if tree_masks:
        lists.tree_mask = []
    for request, tree in zip(batch.decodes, trees):
        start, count = request.num_computed, 1 + len(tree)
        pages = request.pages
        first_row = len(lists.token_ids)
        lists.q_start.append(first_row)
        lists.q_len.append(count)
        lists.kv_len.append(start + count)
        lists.page_table.append(pages)
        lists.lora_slot.append(request.lora_slot)
        lists.token_ids.append((request.output_ids or request.prompt_ids)[-1])
        lists.token_ids.extend(tree.tokens)
        lists.positions.append(start)
        lists.positions.extend(start + depth for depth in tree.depths())
        lists.slots.extend(pages[pos // page_size] * page_size + pos % page_size for pos in range(start, start + count))
        lists.logits_index.extend(range(first_row, first_row + count))
        lists.requests.extend([request] * count)
        if tree_masks:
            lists.tree_mask.extend(tree_mask_rows(tree, start + count))
    for chunk in batch.chunks:
        _append_chunk(lists, chunk, page_size)
        if tree_masks:
            lists.tree_mask.extend([-1] * (chunk.end - chunk.start))
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
        page_table=page_rows, logits_index=list(rows), lora_slot=[r.lora_slot for r in requests],
        requests=list(requests))


def _append_chunk(lists: StepLists, chunk: ScheduledChunk, page_size: int) -> None:
    """Appends any chunk's rows: a prefill chunk's tokens, or a single one."""
    request = chunk.request
    pages = request.pages
    start, end = chunk.start, chunk.end
    lists.q_start.append(len(lists.token_ids))
    lists.q_len.append(end - start)
    lists.kv_len.append(end)
    lists.page_table.append(pages)
    lists.lora_slot.append(request.lora_slot)
    lists.token_ids.extend(request.tokens(start, end))
    lists.positions.extend(range(start, end))
    lists.slots.extend(pages[pos // page_size] * page_size + pos % page_size for pos in range(start, end))
    if chunk.wants_logits:
        lists.logits_index.append(len(lists.token_ids) - 1)
        lists.requests.append(request)
