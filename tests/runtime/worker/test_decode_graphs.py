"""DecodeGraphs' staging of a step's inputs (the CPU path, where the device buffers are CPU tensors):
the page-table rows a turn's buffer already holds are not rewritten, yet every step's table reads
exactly its own rows. The graphs themselves are tested on the GPU (tests/e2e/test_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kiln.runtime.scheduler.batch import StepLists
from kiln.runtime.worker.decode_graphs import DecodeGraphs
from kiln.step_schema import STEP_SCHEMA

WIDTH = 6


def decode_lists(page_rows: list[list[int]]) -> StepLists:
    n = len(page_rows)
    return StepLists(token_ids=[7] * n, positions=[0] * n, slots=[0] * n, q_start=list(range(n)), q_len=[1] * n,
                     kv_len=[1] * n, page_table=page_rows, logits_index=list(range(n)), requests=[])


def staged_table(graphs: DecodeGraphs, lists: StepLists, bucket: int, turn: int) -> list[list[int]]:
    graphs._stage(lists, bucket, turn)
    table = graphs._inputs(bucket, turn).feeds["page_table"]
    # Each row's columns below its page count are what a step reads (padding rows: column 0).
    lengths = [len(row) for row in lists.page_table] + [1] * (bucket - len(lists.page_table))
    return [table[row, :length].tolist() for row, length in enumerate(lengths)]


def test_page_rows_are_staged_incrementally_and_exactly():
    executor = SimpleNamespace(device=torch.device("cpu"), page_size=4, schema=STEP_SCHEMA,
                               bounds={"T": 8, "B": 8, "N": 8, "P": WIDTH})
    graphs = DecodeGraphs(executor, {}, [1, 2, 4], WIDTH)
    steps = [
        [[3], [5, 6]],
        [[3, 8], [5, 6]],               # a row grows by a page: only its tail is new
        [[9, 8], [5, 6], [2]],          # a row's pages change in place at the same length
        [[4]],                          # fewer rows: row 1 becomes padding (page 0)
        [[4], [5, 6, 1, 2]],            # a padding row becomes a real row again
        [[1, 2, 3, 4, 5, 6], [7]],      # a row as wide as the table
    ]
    # All in one turn's buffer, each step against the one before; then the two turns in alternation.
    for step, rows in enumerate(steps + steps):
        lists = decode_lists([list(r) for r in rows])
        bucket = next(b for b in graphs.buckets if b >= len(rows))
        got = staged_table(graphs, lists, bucket, turn=0 if step < len(steps) else step % 2)
        assert got == rows + [[0]] * (bucket - len(rows)), f"step {step}"


def test_ids_already_on_the_device_are_left_alone():
    executor = SimpleNamespace(device=torch.device("cpu"), page_size=4, schema=STEP_SCHEMA,
                               bounds={"T": 8, "B": 8, "N": 8, "P": WIDTH})
    graphs = DecodeGraphs(executor, {}, [2], WIDTH)
    graphs._devices[0][:2] = torch.tensor([11, 12], dtype=torch.int32)
    graphs._stage(decode_lists([[1], [2]]), 2, 0, ids_on_device=True)
    assert graphs._inputs(2, 0).feeds["token_ids"].tolist() == [11, 12]
    graphs._stage(decode_lists([[1], [2]]), 2, 0)
    assert graphs._inputs(2, 0).feeds["token_ids"].tolist() == [7, 7]


def test_warm_up_steps_take_their_buckets_and_store_nothing(tmp_path):
    """``warm_up_lists(b)``, what an idle server runs to capture bucket ``b`` ahead of traffic: a step
    the graphs take at exactly that bucket, one token a sequence or several (a verify step's), whose
    padding sequences store no K/V."""
    from tests.support.runners import cpu_runner

    runner = cpu_runner(tmp_path, max_batch_tokens=32, max_batch_size=4, max_seq_len=32, max_logit_rows=12)
    assert runner.decode_graphs is None  # a CPU core takes no decode buckets by default: made here
    pool = [t.clone() for t in runner.pool.layer_views().values()]
    for k in (1, 3):
        graphs = DecodeGraphs(runner.executor, runner.kv_views, [1, 2, 4], runner.executor.bounds["P"],
                              tokens_per_sequence=k)
        assert graphs.uncaptured() == []  # a CPU captures nothing
        for bucket in graphs.buckets:
            lists = graphs.warm_up_lists(bucket)
            assert graphs.fits(lists) and len(lists.q_len) == bucket
            assert graphs.run(lists).logits.shape[0] == k * bucket
    for before, after in zip(pool, runner.pool.layer_views().values()):
        assert torch.equal(before, after)
