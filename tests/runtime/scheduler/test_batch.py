"""build_step_lists: a mixed batch's index lists, prefill chunks and one-token decode chunks alike."""

from kiln.runtime.sampling import SamplingParams
from kiln.runtime.scheduler.batch import build_step_lists
from kiln.runtime.scheduler.request import Request
from kiln.runtime.scheduler.scheduler import ScheduleBatch, ScheduledChunk


def _request(prompt: list[int], output: list[int], pages: list[int]) -> Request:
    request = Request("r", prompt, SamplingParams(), seed=0)
    request.output_ids.extend(output)
    request.pages = pages
    return request


def test_prefill_and_decode_chunks_in_one_step():
    page_size = 4
    prefill = _request([10, 11, 12, 13, 14, 15], [], pages=[7, 2])      # computes tokens 2..6 of 6
    decode = _request([20, 21, 22, 23], [24], pages=[5, 9])             # token 4 is its first output
    chunked = _request([30, 31, 32, 33, 34], [], pages=[3, 8])          # a chunk that wants no logits
    batch = ScheduleBatch([], [ScheduledChunk(prefill, 2, 6, True), ScheduledChunk(decode, 4, 5, True),
                               ScheduledChunk(chunked, 0, 3, False)])
    lists = build_step_lists(batch, page_size)
    assert lists.token_ids == [12, 13, 14, 15, 24, 30, 31, 32]
    assert lists.positions == [2, 3, 4, 5, 4, 0, 1, 2]
    assert lists.slots == [7 * 4 + 2, 7 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 9 * 4 + 0, 3 * 4 + 0, 3 * 4 + 1, 3 * 4 + 2]
    assert (lists.q_start, lists.q_len, lists.kv_len) == ([0, 4, 5], [4, 1, 3], [6, 5, 3])
    assert lists.page_table == [[7, 2], [5, 9], [3, 8]]
    assert lists.logits_index == [3, 4]
    assert lists.requests == [prefill, decode]


def test_decoding_requests_give_the_same_lists_as_one_token_chunks():
    page_size = 4
    decodes = [_request([1, 2, 3], [4, 5], pages=[6, 2]), _request([7], [], pages=[3]),
               _request([8, 9, 10, 11], [12, 13, 14, 15, 16], pages=[4, 5, 1])]
    for request in decodes:
        request.num_computed = request.total_len - 1    # all but the last token, this step's input
    prefill = _request([20, 21, 22, 23, 24], [], pages=[8, 9])
    chunks = [ScheduledChunk(r, r.total_len - 1, r.total_len, True) for r in decodes]
    prefill_chunk = ScheduledChunk(prefill, 0, 5, True)
    fast = build_step_lists(ScheduleBatch(decodes, [prefill_chunk]), page_size)
    assert fast == build_step_lists(ScheduleBatch([], chunks + [prefill_chunk]), page_size)
    assert fast.token_ids == [5, 7, 16, 20, 21, 22, 23, 24]
    assert fast.slots == [2 * 4 + 0, 3 * 4 + 0, 1 * 4 + 0, 8 * 4 + 0, 8 * 4 + 1, 8 * 4 + 2, 8 * 4 + 3, 9 * 4 + 0]
    assert fast.logits_index == [0, 1, 2, 7] and fast.q_start == [0, 1, 2, 3]
