"""One request's tool handling without a model: the registry's checks, the constraint a tool choice
gives, calls read from whole outputs, and the streamed split giving the same calls."""

from __future__ import annotations

import json

import pytest

from kiln.runtime.sampling import SamplingParams
from kiln.server.errors import APIError
from kiln.server.protocol import ChatCompletionRequest
from kiln.server.tools.parsers import ParsedCall
from kiln.server.tools.request import ToolRequest
from kiln.server.tools.streaming import ToolCallStream

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"]}}}
OUTPUT = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>')


def _tools(parser: str = "hermes", **fields) -> ToolRequest:
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER], **fields)
    return ToolRequest.of(body, parser)


def test_calls_are_read_and_validated():
    tools = _tools()
    result = tools.result(OUTPUT)
    assert result.content == "Checking.\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in result.calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome", "days": 2})]
    assert tools.registry.problem(ParsedCall("get_weather", {"days": 0})) is not None
    assert "unknown function" in tools.registry.problem(ParsedCall("nope", {}))
    # A call that does not validate is dropped; with none left the output is text.
    invalid = OUTPUT.replace('"days": 2', '"days": 0').replace('"city": "Paris"', '"town": "Paris"')
    assert tools.result(invalid).calls == [] and tools.result(invalid).content == invalid


@pytest.mark.parametrize("choice, kind", [("auto", "triggered_tags"), ("required", "tags_with_separator"),
                                          ({"type": "function", "function": {"name": "get_weather"}},
                                           "tags_with_separator")])
def test_tool_choice_sets_a_structural_tag(choice, kind):
    params = SamplingParams()
    _tools(tool_choice=choice).constrain(params)
    assert params.structural_tag["format"]["type"] == kind
    params.validate()


def test_none_sets_no_constraint_and_returns_text():
    params = SamplingParams()
    tools = _tools(tool_choice="none")
    tools.constrain(params)
    assert params.structural_tag is None and tools.result(OUTPUT).calls == []


def test_special_token_formats_keep_special_tokens():
    params = SamplingParams()
    _tools("mistral", tool_choice="required").constrain(params)
    assert params.skip_special_tokens is False


def test_streamed_split_gives_the_same_calls():
    tools = _tools()
    whole = tools.result(OUTPUT)
    splitter, deltas = ToolCallStream(tools), []
    for start in range(0, len(OUTPUT), 3):  # a few characters at a time, across the tags
        deltas += splitter.feed(OUTPUT[start:start + 3])
    # Both calls closed before the output ended, so both went out while it streamed.
    assert sum("tool_calls" in d for d in deltas) == 4
    deltas += splitter.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for delta in deltas:
        for part in delta.get("tool_calls", []):
            call = calls.setdefault(part["index"], {"name": "", "arguments": ""})
            call["name"] += part["function"].get("name", "")
            call["arguments"] += part["function"]["arguments"]
    assert content == whole.content
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole.calls]


def test_text_that_only_looks_like_an_opening_streams_as_content():
    splitter = ToolCallStream(_tools())
    deltas = splitter.feed("a <tool") + splitter.feed("box> b") + splitter.finish()
    assert "".join(d["content"] for d in deltas) == "a <toolbox> b"


def test_tool_choice_needs_tools():
    with pytest.raises(APIError, match="tool_choice needs tools"):
        ToolRequest.of(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tool_choice="required"),
                       "hermes")
