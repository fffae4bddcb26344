"""Request token views."""

from kiln.runtime.sampling import SamplingParams
from kiln.runtime.scheduler.request import Request


def test_tokens_slices_prompt_and_output_like_all_ids():
    request = Request("r", [1, 2, 3, 4], SamplingParams(), seed=0)
    request.output_ids.extend([5, 6, 7])
    ids = request.all_ids
    for start in range(8):
        for end in range(start, 8):
            assert request.tokens(start, end) == ids[start:end], (start, end)
