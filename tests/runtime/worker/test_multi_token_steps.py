"""A decode-like step where a request brings several tokens and wants the logits of each (what
draft verification sends) gives the logits that single-token steps give: one request brings 3
tokens and another 1, against three steps of one token each. Through the prefill graphs' padded
path (what such a step runs as) and the eager path, on a CPU.

Tolerance: f32 weights; the 3-token step attends with the extend kernel path and the single-token
steps with the decode path, which sum the same products in a different order (~1e-6 relative)."""

from __future__ import annotations

import pytest
import torch

from kiln.runtime.worker.decode_graphs import DecodeGraphs
from tests.support.runners import PAGE, cpu_runner
from tests.support.stepping import pages_for, step_lists


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return cpu_runner(tmp_path_factory.mktemp("multi_token"), max_logit_rows=12)


def shifted(rows: list[list[int]], by: int) -> list[list[int]]:
    return [[page + by for page in row] for row in rows]


@pytest.mark.parametrize("path", ["graphs", "eager"])
def test_three_tokens_and_one_equal_single_token_steps(runner, path):
    forward = (lambda lists: (runner.prefill_graphs.run(lists) if path == "graphs" else runner.forward_eager(lists)).logits)
    prompts, drafts = [5, 4], [3, 1]
    # Multi-token: the prompts, then one step where sequence 0 brings 3 tokens and sequence 1 one.
    pages = pages_for([p + d for p, d in zip(prompts, drafts)], PAGE)
    forward(step_lists(prompts, [0, 0], [], pages))
    lists = step_lists(drafts, prompts, [], pages, every_token=(0, 1))
    assert runner.prefill_graphs.fits(lists)
    verified = forward(lists).clone()
    assert verified.shape[0] == 4
    # Single tokens, on other pages: the prompts, one token each, then sequence 0 alone twice more.
    pages = shifted(pages, 20)
    forward(step_lists(prompts, [0, 0], [], pages))
    first = forward(step_lists([1, 1], prompts, [0, 1], pages)).clone()
    second = forward(step_lists([1], [6], [0], pages[:1])).clone()
    third = forward(step_lists([1], [7], [0], pages[:1])).clone()
    expected = torch.stack([first[0], second[0], third[0], first[1]])
    torch.testing.assert_close(verified, expected, atol=1e-4, rtol=1e-4)


def test_decode_graphs_of_three_tokens_a_sequence_equal_single_token_steps(runner):
    """Every sequence brings 3 tokens (a uniform verification step), through the decode graphs'
    padded layout of 3 tokens a sequence: two sequences in the bucket of four."""
    graphs = DecodeGraphs(runner.executor, runner.kv_views, [1, 2, 4], runner.executor.bounds["P"],
                          tokens_per_sequence=3)
    prompts = [5, 4]
    pages = shifted(pages_for([p + 3 for p in prompts], PAGE), 40)
    runner.forward_eager(step_lists(prompts, [0, 0], [], pages))
    lists = step_lists([3, 3], prompts, [], pages, every_token=(0, 1))
    assert graphs.fits(lists) and not graphs.fits(step_lists([3, 1], prompts, [], pages, every_token=(0, 1)))
    result = graphs.run(lists)
    verified = result.logits.clone()
    assert verified.shape[0] == 6 and result.greedy.tolist() == verified.argmax(dim=-1).tolist()
    pages = shifted(pages, 10)
    runner.forward_eager(step_lists(prompts, [0, 0], [], pages))
    singles = [runner.forward_eager(step_lists([1, 1], [p + i for p in prompts], [0, 1], pages)).logits.clone()
               for i in range(3)]
    expected = torch.stack([singles[i][seq] for seq in range(2) for i in range(3)])
    torch.testing.assert_close(verified, expected, atol=1e-4, rtol=1e-4)
