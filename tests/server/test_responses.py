"""``ChunkFrames``: a stream's SSE frames, its repeated fields serialized once, carry the same JSON as
``sse(chunk(...))`` for every kind of choice a stream sends (text, role, finish, logprobs, non-ASCII)."""

from __future__ import annotations

import json

import pytest

from kiln.server.responses import ChunkFrames, Usage, chunk, sse

CHOICES = [
    {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None},
    {"index": 1, "delta": {"content": " héllo \"quoted\" ✓"}, "logprobs": None, "finish_reason": None},
    {"index": 0, "text": "x", "logprobs": {"tokens": ["x"], "token_logprobs": [-0.5]}, "finish_reason": "stop",
     "matched_stop": 2},
]


@pytest.mark.parametrize("obj", ["chat.completion.chunk", "text_completion"])
def test_frames_carry_the_same_json_as_a_whole_chunk(obj):
    frames = ChunkFrames("cmpl-1", obj, 1733400000, "mødel \"x\"")
    for choice in CHOICES:
        frame = frames.frame(choice)
        expected = sse(chunk("cmpl-1", obj, 1733400000, "mødel \"x\"", [choice]))
        assert frame.startswith("data: ") and frame.endswith("\n\n") and "\n" not in frame[:-2]
        assert json.loads(frame[6:]) == json.loads(expected[6:])
    usage = Usage(prompt_tokens=3, completion_tokens=4)
    assert frames.usage_frame(usage) == sse(chunk("cmpl-1", obj, 1733400000, "mødel \"x\"", [], usage))
