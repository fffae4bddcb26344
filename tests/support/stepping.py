"""Driving an Executor by hand: prefill a batch of prompts, then decode greedily, through a paged pool;
and step lists (what the scheduler hands the model runner) built by hand.

Pages are handed out in order (no allocator, no scheduler): this isolates the compiled program
and the kernels from the runtime's bookkeeping.
"""

from __future__ import annotations

import torch

from kiln.runtime.kvcache.pool import pool_dtype
from kiln.runtime.scheduler.batch import StepLists
from kiln.runtime.worker.executor import Executor, StepInputs
from kiln.runtime.worker.expert_load import ExpertLoad


class PagedRun:
    def __init__(self, executor: Executor, num_pages: int) -> None:
        rt = executor.artifact.runtime
        self.executor = executor
        self.page_size = rt["page_size"]
        self.caches = {}
        for i in range(rt["num_layers"]):
            for kind in ("k", "v"):
                self.caches[f"{kind}_cache.{i}"] = torch.zeros(
                    num_pages * self.page_size, rt["num_kv_heads"], rt["head_dim"],
                    dtype=pool_dtype(rt), device=executor.device)
        self.caches.update(ExpertLoad(rt.get("expert_load", []), executor.device).views())  # a MoE model's counters
        self.next_page = 1  # page 0 stays unused, as in the runtime's pool
        self.pages: list[list[int]] = []
        self.lengths: list[int] = []

    def add_sequences(self, count: int) -> None:
        self.pages.extend([] for _ in range(count))
        self.lengths.extend(0 for _ in range(count))

    def step(self, new_tokens: list[list[int]], all_logits: bool = False) -> torch.Tensor:
        """Runs one step where sequence b gets ``new_tokens[b]``; returns logits of each sequence's
        last token, or of every token with ``all_logits``."""
        ids, positions, slots, q_start, q_len, kv_len = [], [], [], [], [], []
        for b, tokens in enumerate(new_tokens):
            q_start.append(len(ids))
            q_len.append(len(tokens))
            for t in tokens:
                pos = self.lengths[b]
                if pos // self.page_size >= len(self.pages[b]):
                    self.pages[b].append(self.next_page)
                    self.next_page += 1
                slots.append(self.pages[b][pos // self.page_size] * self.page_size + pos % self.page_size)
                ids.append(t)
                positions.append(pos)
                self.lengths[b] += 1
            kv_len.append(self.lengths[b])
        width = max(len(p) for p in self.pages)
        table = [p + [0] * (width - len(p)) for p in self.pages[: len(new_tokens)]]
        if all_logits:
            index = list(range(len(ids)))
        else:
            index = [s + n - 1 for s, n in zip(q_start, q_len)]
        dev = self.executor.device

        def i32(values):
            return torch.tensor(values, dtype=torch.int32, device=dev)

        feeds = {"token_ids": i32(ids), "positions": i32(positions), "slots": i32(slots), "q_start": i32(q_start),
                 "q_len": i32(q_len), "kv_len": i32(kv_len), "page_table": i32(table).reshape(len(new_tokens), width),
                 "logits_index": i32(index)}
        inputs = StepInputs(feeds, max(q_len), max(kv_len))
        return self.executor.run(inputs, self.caches)["logits"].clone()


def pages_for(totals: list[int], page_size: int = 4) -> list[list[int]]:
    """Consecutive pages for sequences of these lengths, from page 1 (page 0 is reserved)."""
    rows, next_page = [], 1
    for total in totals:
        rows.append(list(range(next_page, next_page + -(-total // page_size))))
        next_page += len(rows[-1])
    return rows


def step_lists(new_tokens: list[int], cached: list[int], logits_rows: list[int], page_rows: list[list[int]],
               page_size: int = 4, every_token: tuple[int, ...] = (), first_token: int = 3) -> StepLists:
    """Sequence i adds new_tokens[i] tokens after cached[i] ones, on page_rows[i]; logits for the
    sequences in logits_rows at their last token, and for those in ``every_token`` at each new token
    (as draft verification wants). Token ids are a function of (sequence, position), so steps that
    split a sequence differently feed it the same tokens."""
    lists = StepLists.empty()
    for i, (n, before) in enumerate(zip(new_tokens, cached)):
        lists.q_start.append(len(lists.token_ids))
        for pos in range(before, before + n):
            if i in every_token:
                lists.logits_index.append(len(lists.token_ids))
            lists.token_ids.append(first_token + 7 * i + pos)
            lists.positions.append(pos)
            lists.slots.append(page_rows[i][pos // page_size] * page_size + pos % page_size)
        lists.q_len.append(n)
        lists.kv_len.append(before + n)
        lists.page_table.append(page_rows[i])
        if i in logits_rows and i not in every_token:
            lists.logits_index.append(len(lists.token_ids) - 1)
    return lists
