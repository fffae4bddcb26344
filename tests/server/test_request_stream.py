"""RequestStream: deltas in arrival order, a sample's waiting deltas handed out as one."""

import asyncio

import pytest

from kiln.server.errors import APIError
from kiln.server.request_stream import RequestStream, SampleOutput, TokenLogprob


def delta(text: str, token: int, index: int = 0, finish: str | None = None, prompt_logprobs=()) -> SampleOutput:
    return SampleOutput(0, index, text, [token], [TokenLogprob(token, text.encode(), -0.5)], finish,
                        list(prompt_logprobs), "." if finish == "stop" else None)


def drain(stream: RequestStream) -> list[SampleOutput]:
    async def collect():
        return [item async for item in stream]
    return asyncio.run(collect())


def test_a_samples_waiting_deltas_come_out_as_one():
    stream = RequestStream(None, samples=1, max_tokens_param="max_tokens")
    for i, text in enumerate(["The", " capital", " is"]):
        stream.put(delta(text, i, prompt_logprobs=[-1.0] if i == 0 else []))
    stream.put(delta(" Paris", 3, finish="stop"))
    [joined] = drain(stream)
    assert (joined.text, joined.token_ids, joined.finish_reason, joined.matched_stop) == \
        ("The capital is Paris", [0, 1, 2, 3], "stop", ".")
    assert [lp.token_id for lp in joined.logprobs] == [0, 1, 2, 3] and joined.prompt_logprobs == [-1.0]
    assert stream.usage.completion_tokens == 4


def test_deltas_of_other_samples_and_after_a_finish_stay_apart():
    stream = RequestStream(None, samples=2, max_tokens_param="max_tokens")
    for item in [delta("a", 1, index=0), delta("b", 2, index=0), delta("x", 9, index=1),
                 delta("c", 3, index=0, finish="length"), delta("y", 8, index=1, finish="length")]:
        stream.put(item)
    assert [(d.index, d.text, d.finish_reason) for d in drain(stream)] == \
        [(0, "ab", None), (1, "x", None), (0, "c", "length"), (1, "y", "length")]


def test_deltas_before_an_error_come_out_first():
    stream = RequestStream(None, samples=1, max_tokens_param="max_tokens")
    stream.put(delta("a", 1))
    stream.put(APIError(500, "the engine failed"))

    async def read():
        first = await stream.__anext__()
        with pytest.raises(APIError):
            await stream.__anext__()
        return first
    assert asyncio.run(read()).text == "a"


def test_a_reader_waiting_for_the_first_delta_gets_it():
    stream = RequestStream(None, samples=1, max_tokens_param="max_tokens")

    async def read_then_put():
        reader = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.01)
        assert not reader.done()
        stream.put(delta("a", 1, finish="stop"))
        return await reader
    assert asyncio.run(read_then_put()).text == "a"
