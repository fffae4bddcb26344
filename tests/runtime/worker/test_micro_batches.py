"""Splitting a step into micro-batches: consecutive sequences of about equal tokens, each part a step
of its own (token offsets rebased), and the logits rows of every part put back in the step's order
(prompt-logprob rows after the sampled ones included)."""

from kiln.runtime.worker.micro_batches import split_step
from kiln.step_schema import STEP_SCHEMA
from tests.support.stepping import Pages


def prefill_lists(prompt_lengths: list[int]):
    pages = Pages(page_size=4)
    pages.add_sequences(len(prompt_lengths))
    return pages.lists([[7] * n for n in prompt_lengths])


def test_a_prefill_splits_into_two_parts_of_about_equal_tokens():
    lists = prefill_lists([7, 2, 11, 1])
    first, second = split_step(lists, STEP_SCHEMA, 2)
    assert first.lists.q_len == [7, 2] and second.lists.q_len == [11, 1]
    assert second.lists.q_start == [0, 11]
    assert second.lists.token_ids == lists.token_ids[9:] and second.lists.slots == lists.slots[9:]
    assert second.lists.page_table == lists.page_table[2:] and second.lists.kv_len == [11, 1]
    assert first.lists.logits_index == [6, 8] and second.lists.logits_index == [10, 11]
    assert first.rows + second.rows == [0, 1, 2, 3]


def test_logits_rows_return_to_the_step_order():
    lists = prefill_lists([3, 3, 3, 3])
    lists.logits_index = [2, 5, 8, 11, 0, 7]  # the sampled rows, then prompt-logprob rows of sequences 0 and 2
    first, second = split_step(lists, STEP_SCHEMA, 2)
    assert first.rows == [0, 1, 4] and first.lists.logits_index == [2, 5, 0]
    assert second.rows == [2, 3, 5] and second.lists.logits_index == [2, 5, 1]


def test_a_step_of_one_sequence_is_one_part():
    lists = prefill_lists([5])
    (only,) = split_step(lists, STEP_SCHEMA, 2)
    assert only.lists == lists and only.rows == [0]


def test_decode_steps_split_by_sequences():
    lists = prefill_lists([1, 1, 1, 1, 1])
    parts = split_step(lists, STEP_SCHEMA, 2)
    assert [part.lists.q_len for part in parts] == [[1, 1], [1, 1, 1]]
