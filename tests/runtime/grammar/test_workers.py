"""GrammarWorkers: a step's accepts and fills split into runs on several threads give the verdicts,
states and mask rows that one thread gives accepting and filling row by row, including a token that
ends its grammar (its row then allows everything), a token the grammar rejects (its state unchanged)
and rows only filled or only accepted; a handful of rows runs on the calling thread."""

from __future__ import annotations

import numpy as np
import torch

from kiln.runtime.grammar import GrammarState, allocate_bitmask
from kiln.runtime.grammar.workers import MIN_ROWS_PER_RUN, GrammarWorkers, RowWork

from .conftest import PADDED_VOCAB
from .test_step_mask import walks


def positioned(grammar_compiler, random_walk) -> list[tuple[GrammarState, int | None, bool]]:
    """(state, token to accept, fill its row?) items: every grammar at several points of its walk,
    the last of each just before its stop token; one token the grammar rejects; some only filled,
    some only accepted."""
    items = []
    for walk_index, (state, tokens) in enumerate(walks(grammar_compiler, random_walk)):
        for position in sorted({0, 1, len(tokens) // 2, len(tokens) - 1}):
            items.append((GrammarState.replay(state.grammar, tokens[:position]), tokens[position], True))
        items.append((GrammarState.replay(state.grammar, tokens[:1]), None, True))
        items.append((GrammarState.replay(state.grammar, tokens[:2]), tokens[2], False))
    rejecting = GrammarState(walks(grammar_compiler, random_walk)[1][0].grammar)  # the regex: letters first
    row = allocate_bitmask(1, PADDED_VOCAB)
    rejecting.fill_bitmask(row, 0)
    bits = np.unpackbits(row[0].numpy().view(np.uint8), bitorder="little")
    items.append((rejecting, int(np.flatnonzero(bits == 0)[0]), True))
    return items


def one_thread(items) -> tuple[list[bool], torch.Tensor, list[tuple[int, bool]]]:
    """The reference: accept row by row, then fill the rows still live one at a time."""
    verdicts = [state.accept(token) if token is not None else True for state, token, _ in items]
    mask = allocate_bitmask(len(items), PADDED_VOCAB)
    for row, ((state, token, fill), ok) in enumerate(zip(items, verdicts)):
        if fill and ok and not state.is_terminated():
            state.fill_bitmask(mask, row)
    return verdicts, mask, [(s.num_accepted, s.is_terminated()) for s, _, _ in items]


def test_runs_on_threads_equal_one_thread_row_by_row(grammar_compiler, random_walk):
    expected = one_thread(positioned(grammar_compiler, random_walk))
    items = positioned(grammar_compiler, random_walk)
    assert len(items) >= 3 * MIN_ROWS_PER_RUN  # three runs
    workers = GrammarWorkers(3)
    mask = allocate_bitmask(len(items), PADDED_VOCAB)
    mask.fill_(7)  # a stale buffer: every row the work names is written
    work = [RowWork(state, token, row if fill else None) for row, (state, token, fill) in enumerate(items)]
    job = workers.start(work, mask)
    verdicts = job.accepted()
    job.wait()
    workers.shutdown()
    assert verdicts == expected[0] and not all(verdicts)
    filled = [row for row, (_, _, fill) in enumerate(items) if fill]
    assert torch.equal(mask[filled], expected[1][filled])
    assert [(s.num_accepted, s.is_terminated()) for s, _, _ in items] == expected[2]
    assert any(terminated for _, terminated in expected[2])  # a stop token was among them


def test_a_few_rows_run_on_the_calling_thread(grammar_compiler, random_walk):
    items = positioned(grammar_compiler, random_walk)[:MIN_ROWS_PER_RUN - 1]
    expected = one_thread(positioned(grammar_compiler, random_walk)[:MIN_ROWS_PER_RUN - 1])
    workers = GrammarWorkers(4)
    mask = allocate_bitmask(len(items), PADDED_VOCAB)
    job = workers.start([RowWork(s, t, r if f else None) for r, (s, t, f) in enumerate(items)], mask)
    assert workers._pool is None  # no thread started
    assert job.accepted() == expected[0]
    job.wait()
    assert torch.equal(mask, expected[1])
