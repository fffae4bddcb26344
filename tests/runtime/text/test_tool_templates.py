"""The built-in tool template: chosen when a model's template ignores ``tools``, rendering tools,
assistant calls and tool results in the Hermes format."""

from __future__ import annotations

import json

import pytest
import tokenizers

from kiln.runtime.text.tokenizer import Tokenizer
from kiln.runtime.text.tool_templates import HERMES_TOOL_TEMPLATE, mentions_tools, uses_tools

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
EXCHANGE = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
    {"role": "tool", "tool_call_id": "a", "content": "18 C"},
    {"role": "tool", "tool_call_id": "b", "content": "25 C"},
]


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return Tokenizer.from_dir(smollm2_dir)


def test_smollm2_template_has_no_tools_so_the_builtin_one_renders_them(smollm2):
    assert not mentions_tools(smollm2.chat_template)
    assert smollm2.tool_chat_template == HERMES_TOOL_TEMPLATE
    text = smollm2.apply_chat_template(EXCHANGE, tools=[TOOL])
    expected = (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query."
        "\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(TOOL) +
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
        "<args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
        "</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>"
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\n25 C\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert text == expected


def test_without_tools_the_models_own_template_renders(smollm2):
    plain = [{"role": "user", "content": "Hi"}]
    assert not uses_tools(plain, None)
    assert smollm2.apply_chat_template(plain).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_a_template_with_tools_is_kept(smollm2):
    own = "{% for tool in tools or [] %}{{ tool.function.name }};{% endfor %}{{ messages[-1]['content'] }}"
    assert mentions_tools(own)
    tokenizer = Tokenizer(smollm2.backend, chat_template=own)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tools=[TOOL]) == "get_weather;Hi"


def test_no_fitting_tool_template_is_a_clear_error():
    # A vocabulary without ChatML markers and a template without tools: nothing can render them.
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"hi": 0, "<unk>": 1}, unk_token="<unk>"))
    tokenizer = Tokenizer(backend, chat_template="{{ messages[0]['content'] }}")
    assert tokenizer.tool_chat_template is None
    with pytest.raises(ValueError, match="no tools section and no built-in tool template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tools=[TOOL])
