"""``kiln serve --stream-interval N``: which events leave the scheduler (``StreamInterval``, on the
engine core's own event records), and a real server of a tiny model streaming to the official
``openai`` client in chunks of N tokens after a first chunk of one, with the text of a stream at
interval 1; a bad interval is refused by name before anything starts."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest

from kiln.runtime.outputs import SampleEvent, TokenLogprob
from kiln.server.stream_interval import StreamInterval
from tests.server.harness import API_KEY, MODEL, ServerProcess, tiny_artifact

INTERVAL = 4


def token(rid: str, value: int, index: int = 0, **fields) -> SampleEvent:
    return SampleEvent(rid, index, (value,), **fields)


def test_first_token_at_once_then_every_interval_and_the_rest_with_the_finish():
    stream = StreamInterval(3)
    assert stream.release([token("a", 1)]) == [token("a", 1)]
    assert stream.release([token("a", 2)]) == []
    assert stream.release([token("a", 3)]) == []
    assert stream.release([token("a", 4, prompt_tokens=7)]) == [SampleEvent("a", 0, (2, 3, 4), prompt_tokens=7)]
    assert stream.release([token("a", 5)]) == []
    assert stream.release([token("a", 6, finish_reason="length")]) == [
        SampleEvent("a", 0, (5, 6), finish_reason="length")]
    assert stream.release([token("a", 7)]) == [token("a", 7)]  # a new request reusing the id starts afresh


def test_samples_are_held_apart_and_an_abort_sends_what_was_held():
    stream = StreamInterval(8)
    assert stream.release([token("a", 1), token("a", 1, index=1), token("b", 9)]) == [
        token("a", 1), token("a", 1, index=1), token("b", 9)]
    assert stream.release([token("a", 2), token("a", 3, index=1), token("b", 10)]) == []
    aborted = SampleEvent("a", 0, (), finish_reason="abort", error="gone")
    assert stream.release([aborted]) == [SampleEvent("a", 0, (2,), finish_reason="abort", error="gone")]
    assert stream.release([token("b", 11, finish_reason="stop", matched_stop=11)]) == [
        SampleEvent("b", 0, (10, 11), finish_reason="stop", matched_stop=11)]


def test_logprobs_join_and_the_prompt_logprobs_stay_with_the_first_tokens():
    stream = StreamInterval(2)
    first = lambda v: TokenLogprob(v, -0.5, ())  # noqa: E731
    assert stream.release([token("a", 1, logprobs=(first(1),), prompt_logprobs=(-1.0,))])
    assert stream.release([token("a", 2, logprobs=(first(2),))]) == []
    assert stream.release([token("a", 3, logprobs=(first(3),))]) == [
        SampleEvent("a", 0, (2, 3), (first(2), first(3)))]


def test_interval_one_passes_events_through_and_zero_is_refused():
    events = [token("a", 1), token("a", 2)]
    assert StreamInterval(1).release(events) is events
    with pytest.raises(ValueError, match="--stream-interval: must be at least 1, got 0"):
        StreamInterval(0)


@pytest.fixture(scope="module")
def tiny(smollm2_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("stream_interval")
    return tiny_artifact(smollm2_dir, root), root


def test_a_server_streams_chunks_of_the_interval(tiny):
    artifact, root = tiny
    with ServerProcess(artifact, root / "serve.log", "--stream-interval", str(INTERVAL)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        request = dict(model=MODEL, prompt="Count: one, two,", max_tokens=15, temperature=0, logprobs=1,
                       extra_body={"ignore_eos": True})
        chunks = [c.choices[0] for c in client.completions.create(stream=True, **request) if c.choices]
        whole = client.completions.create(**request).choices[0]
    assert [len(c.logprobs.tokens) for c in chunks if c.logprobs] == [1, 4, 4, 4, 2]
    assert chunks[-1].finish_reason == "length"
    assert "".join(c.text for c in chunks) == whole.text
    assert sum((c.logprobs.tokens for c in chunks if c.logprobs), []) == whole.logprobs.tokens


def test_a_bad_interval_is_refused_before_anything_starts(tiny):
    artifact, _ = tiny
    result = subprocess.run([sys.executable, "-m", "kiln", "serve", str(artifact), "--device", "cpu",
                             "--stream-interval", "0"], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "--stream-interval: must be at least 1, got 0" in result.stderr
