"""Tool calling through the official ``openai`` client against the real SmolLM2 server.

``required`` and named ``tool_choice`` over 20 tool schemas (nested objects, enums, arrays, required
fields; tests/server/tools/data/tool_schemas.json): every call's arguments parse and validate.
``auto`` with a prompt that asks for a call gives ``tool_calls``, and its streamed deltas assemble
into the same call. A multi-turn exchange feeds a tool result back. Malformed tools are 400s.
Requests run concurrently (one batch on the engine) and ask for few tokens: SmolLM2 on CPU is slow.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.server.harness import API_KEY, MODEL

CASES = json.loads((Path(__file__).parent / "data" / "tool_schemas.json").read_text())
TOOLS = {case["tool"]["function"]["name"]: case["tool"] for case in CASES}
WEATHER = TOOLS["get_weather"]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    """The official client, patient: a batch of constrained generations on a loaded CPU takes a while."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=900)


def _check_call(call, offered: list[str]) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in offered
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, TOOLS[call.function.name]["function"]["parameters"])
    return arguments


def _ask(client, index: int):
    """Even cases name their tool; odd ones offer it and the next one with tool_choice "required"."""
    case = CASES[index]
    name = case["tool"]["function"]["name"]
    if index % 2 == 0:
        tools, choice = [case["tool"]], {"type": "function", "function": {"name": name}}
    else:
        tools, choice = [case["tool"], CASES[(index + 1) % len(CASES)]["tool"]], "required"
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": case["prompt"]}], tools=tools, tool_choice=choice,
        parallel_tool_calls=False, temperature=0, max_tokens=120)
    return response, [t["function"]["name"] for t in tools], choice


def test_required_and_named_calls_validate_over_20_schemas(client):
    assert len(CASES) == 20
    with ThreadPoolExecutor(len(CASES)) as pool:
        results = list(pool.map(lambda i: _ask(client, i), range(len(CASES))))
    for response, offered, choice in results:
        choice_out = response.choices[0]
        assert choice_out.finish_reason == "tool_calls", (offered, choice_out)
        assert len(choice_out.message.tool_calls) == 1  # parallel_tool_calls: false
        call = choice_out.message.tool_calls[0]
        if isinstance(choice, dict):
            assert call.function.name == choice["function"]["name"]
        _check_call(call, offered)


def _assemble(chunks) -> tuple[str, dict[int, dict], str | None]:
    content, calls, reason = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = part.id or call["id"]
            call["name"] += (part.function.name or "") if part.function else ""
            call["arguments"] += (part.function.arguments or "") if part.function else ""
        reason = chunk.choices[0].finish_reason or reason
    return content, calls, reason


def test_auto_calls_a_tool_and_streaming_gives_the_same_call(client):
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Respond with a <tool_call> that calls get_weather "
                                                                  "for London."}],
               tools=[WEATHER], tool_choice="auto", parallel_tool_calls=False, temperature=0, max_tokens=60)
    with ThreadPoolExecutor(2) as pool:
        whole = pool.submit(client.chat.completions.create, **ask)
        streamed = pool.submit(lambda: _assemble(client.chat.completions.create(**ask, stream=True)))
        response, (content, calls, reason) = whole.result(), streamed.result()
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "tool_calls" and message.tool_calls
    arguments = _check_call(message.tool_calls[0], ["get_weather"])
    assert message.tool_calls[0].function.name == "get_weather" and arguments["city"] == "London"
    assert reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert content.strip() == (message.content or "").strip()


def test_multi_turn_with_a_tool_result(client):
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
    ]
    response = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                              temperature=0, max_tokens=24)
    choice = response.choices[0]
    assert choice.message.tool_calls is None
    assert "18" in choice.message.content  # the answer reads the tool's result
    # The same history without the tool result renders a shorter prompt: the result was in it.
    shorter = client.chat.completions.create(model=MODEL, messages=history[:2], tools=[WEATHER], tool_choice="none",
                                             temperature=0, max_tokens=1)
    assert response.usage.prompt_tokens > shorter.usage.prompt_tokens


@pytest.mark.parametrize("tools, choice, param", [
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}], "auto",
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "auto",
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"description": "no name"}}], "auto", "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "has space"}}], "auto", "tools[0].function.name"),
    ([WEATHER, WEATHER], "auto", "tools[1].function.name"),
    ([{"type": "retrieval", "function": {"name": "f"}}], "auto", "tools[0].type"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    (None, "required", "tool_choice"),
])
def test_bad_tools_are_400s_naming_them(client, tools, choice, param):
    extra = {"tools": tools} if tools is not None else {}
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], tool_choice=choice,
                                       max_tokens=5, **extra)
    assert error.value.body["param"] == param, error.value.body
    assert param.split(".")[0].split("[")[0] in error.value.body["message"]


def test_required_tool_choice_with_response_format_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=[WEATHER],
                                       tool_choice="required", response_format={"type": "json_object"}, max_tokens=5)
    assert error.value.body["param"] == "tool_choice" and "response_format" in error.value.body["message"]
