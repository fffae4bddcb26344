"""Driving an Executor by hand: prefill a batch of prompts, then decode greedily, through a paged pool;
and step lists (what the scheduler hands the model runner) built by hand.

Pages are handed out in order (no allocator, no scheduler): this isolates the compiled program
and the kernels from the runtime's bookkeeping.
"""

from __future__ import annotations

from typing import Callable

import torch

from kiln.runtime.kvcache.pool import pool_dtype
from kiln.runtime.scheduler.batch import StepLists
from kiln.runtime.worker.executor import Executor, StepInputs, StepResult
from kiln.runtime.worker.expert_load import ExpertLoad


class Pages:
    """Sequences' pages, handed out in order from page 1, and the step lists that feed them tokens."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.next_page = 1  # page 0 stays unused, as in the runtime's pool
        self.pages: list[list[int]] = []
        self.lengths: list[int] = []

    def add_sequences(self, count: int) -> None:
        self.pages.extend([] for _ in range(count))
        self.lengths.extend(0 for _ in range(count))

    def lists(self, new_tokens: list[list[int]], all_logits: bool = False) -> StepLists:
        """The step's lists (what the scheduler would hand a model runner), taking the pages it needs."""
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
        return StepLists([], token_ids=ids, positions=positions, slots=slots, q_start=q_start, q_len=q_len,
                         kv_len=kv_len, page_table=table, logits_index=index)


class PagedRun(Pages):
    """Steps through an executor, on KV caches of its own."""

    def __init__(self, executor: Executor, num_pages: int) -> None:
        rt = executor.artifact.runtime
        super().__init__(rt["page_size"])
        self.executor = executor
        self.caches = {}
        for i in range(rt["num_layers"]):
            for kind in ("k", "v"):
                self.caches[f"{kind}_cache.{i}"] = torch.zeros(
                    num_pages * self.page_size, rt["num_kv_heads"], rt["head_dim"],
                    dtype=pool_dtype(rt), device=executor.device)
        self.caches.update(ExpertLoad(rt.get("expert_load", []), executor.device).views())  # a MoE model's counters

    def step(self, new_tokens: list[list[int]], all_logits: bool = False) -> torch.Tensor:
        """Runs one step where sequence b gets ``new_tokens[b]``; returns logits of each sequence's
        last token, or of every token with ``all_logits``."""
        lists = self.lists(new_tokens, all_logits)
        dev = self.executor.device

        def i32(values):
            return torch.tensor(values, dtype=torch.int32, device=dev)

        width = len(lists.page_table[0])
        feeds = {name: i32(lists.column(name)) for name in ("token_ids", "positions", "slots", "q_start", "q_len",
                                                            "kv_len", "logits_index")}
        feeds["page_table"] = i32(lists.page_table).reshape(len(new_tokens), width)
        inputs = StepInputs(feeds, max(lists.q_len), max(lists.kv_len))
        return self.executor.run(inputs, self.caches)["logits"].clone()


class RunnerRun(Pages):
    """Steps as a ``PagedRun`` takes them, through a model runner's (or worker's) ``forward``, on the
    runner's own KV pool."""

    def __init__(self, forward: Callable[[StepLists], StepResult], page_size: int) -> None:
        super().__init__(page_size)
        self.forward = forward

    def step(self, new_tokens: list[list[int]], all_logits: bool = False) -> torch.Tensor:
        return self.forward(self.lists(new_tokens, all_logits)).logits.clone()


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
