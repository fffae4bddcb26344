"""The prefill graphs' buckets and padding, on a CPU (where the padded path runs eagerly over the same
static buffers the GPU captures): the logits of a padded step equal the unpadded step's. The GPU
capture and replay are checked in tests/e2e/test_gpu.py."""

from __future__ import annotations

import pytest
import torch

from kiln.runtime.worker.prefill_graphs import bucket_sizes
from tests.support.runners import cpu_runner
from tests.support.stepping import pages_for, step_lists


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return cpu_runner(tmp_path_factory.mktemp("prefill_graphs"), max_batch_tokens=40, max_batch_size=6,
                      max_seq_len=64)


def test_bucket_sizes():
    assert bucket_sizes(16, 40) == [16, 32, 40]
    assert bucket_sizes(16, 64) == [16, 32, 64]
    assert bucket_sizes(1, 6) == [1, 2, 4, 6]
    assert bucket_sizes(16, 8) == [8]


@pytest.mark.parametrize("new_tokens, cached, logits_rows", [
    ([5], [0], [0]),                       # one short prompt: 16-token bucket, 1 sequence
    ([17, 3, 1], [0, 0, 0], [0, 1, 2]),    # three sequences: 32-token bucket, 4 sequences
    ([9, 6], [0, 0], [1]),                 # a middle chunk (no logits) beside a prompt's last chunk
    ([30, 4, 2, 1, 1], [0, 8, 0, 11, 3], [0, 1, 2, 3, 4]),  # the largest token bucket (40), 6 sequences
])
def test_padded_step_equals_unpadded(runner, new_tokens, cached, logits_rows):
    page_rows = pages_for([n + c for n, c in zip(new_tokens, cached)])
    if any(cached):
        # Store the cached tokens' K/V first (an eager step of them alone), so that both runs below
        # attend over real context.
        with_context = [i for i, c in enumerate(cached) if c]
        runner.forward_eager(step_lists([cached[i] for i in with_context], [0] * len(with_context), [],
                                        [page_rows[i] for i in with_context]))
    lists = step_lists(new_tokens, cached, logits_rows, page_rows)
    assert runner.prefill_graphs.fits(lists)
    padded = runner.prefill_graphs.run(lists).logits.clone()
    unpadded = runner.forward_eager(lists).logits
    assert padded.shape == (len(logits_rows), unpadded.shape[1])
    torch.testing.assert_close(padded, unpadded, atol=1e-5, rtol=1e-5)


def test_steps_past_the_largest_buckets_do_not_fit(runner):
    assert not runner.prefill_graphs.fits(step_lists([41], [0], [0], pages_for([41])))
    assert not runner.prefill_graphs.fits(step_lists([1] * 7, [0] * 7, list(range(7)), pages_for([1] * 7)))


def test_warm_up_steps_take_their_buckets_and_store_nothing(runner):
    graphs = runner.prefill_graphs
    # Bounds 40 tokens, 6 sequences, 64-token sequences: every pair with more tokens than sequences.
    assert graphs.warm_up_buckets() == [(t, b) for t in (16, 32, 40) for b in (1, 2, 4, 6)]
    assert graphs.uncaptured() == []  # a CPU captures nothing
    pool = [t.clone() for t in runner.pool.layer_views().values()]
    for tokens, sequences in graphs.warm_up_buckets():
        lists = graphs.warm_up_lists((tokens, sequences))
        assert graphs.fits(lists) and not (runner.decode_graphs and runner.decode_graphs.fits(lists))
        assert graphs._buckets(len(lists.token_ids), len(lists.q_len), len(lists.logits_index)) == \
            {"T": tokens, "B": sequences, "N": sequences}
        assert sorted(lists.q_len)[-1] - sorted(lists.q_len)[0] <= 1 and sum(lists.q_len) == tokens
        assert graphs.run(lists).logits.shape[0] == sequences
    for before, after in zip(pool, runner.pool.layer_views().values()):
        assert torch.equal(before, after)


def test_warm_up_leaves_out_buckets_of_more_sequences_than_logits_rows(tmp_path):
    """A step of more sequences than the artifact's logits rows takes no graph: warming such a bucket
    would never capture it (and an idle server would run it again and again)."""
    runner = cpu_runner(tmp_path, max_batch_tokens=32, max_batch_size=8, max_seq_len=64, max_logit_rows=4)
    assert runner.prefill_graphs.warm_up_buckets() == [(t, b) for t in (16, 32) for b in (1, 2, 4)]
