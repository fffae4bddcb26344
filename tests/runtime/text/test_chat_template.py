"""Chat templates: parity with transformers on SmolLM2's template, the sandbox, message validation,
error reporting and the built-in templates."""

from __future__ import annotations

import pytest

from kiln.runtime.text.chat_template import (
    CHATML_TEMPLATE,
    LLAMA2_TEMPLATE,
    LLAMA3_TEMPLATE,
    MISTRAL_TEMPLATE,
    builtin_template,
    render_chat_template,
    validate_messages,
)

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! 😀"},
     {"role": "user", "content": "Say 你好"}],
]

USER_ASSISTANT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_matches_transformers(smollm2, hf_smollm2, add_generation_prompt):
    for messages in CONVERSATIONS:
        ours = smollm2.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        theirs = hf_smollm2.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert ours == theirs
        assert smollm2.encode_chat(messages, add_generation_prompt) == hf_smollm2.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False)


def test_tools_and_tojson_match_transformers(hf_smollm2):
    template = ("{% if tools %}{% for tool in tools %}{{ tool | tojson }}\n{{ tool | tojson(indent=2) }}\n"
                "{% endfor %}{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    tools = [{"type": "function", "function": {"name": "weather", "description": "Wetter für <Orte> & 'Städte'",
                                               "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "user", "content": "Wie ist das Wetter?"}]
    ours = render_chat_template(template, messages, tools=tools)
    theirs = hf_smollm2.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False)
    assert ours == theirs
    assert "Wetter für <Orte> & 'Städte'" in ours


def test_trim_and_lstrip_blocks():
    template = "{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}"
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert render_chat_template(template, messages) == "a\nb\n"


def test_context_variables_and_helpers():
    template = ("{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}|{{ enable_thinking }}|"
                "{{ strftime_now('%Y') | length }}|{% generation %}{{ messages[0].content }}{% endgeneration %}"
                "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}.{% endfor %}")
    messages = [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]
    rendered = render_chat_template(template, messages, add_generation_prompt=False, bos_token="<s>",
                                    eos_token="</s>", extra_context={"enable_thinking": False})
    assert rendered == "<s>|</s>|False|False|4|x."


def test_raise_exception_becomes_value_error():
    template = ("{% if messages[0].role != 'system' %}{{ raise_exception('a system message must come first') }}"
                "{% endif %}")
    with pytest.raises(ValueError, match="a system message must come first"):
        render_chat_template(template, [{"role": "user", "content": "hi"}])


def test_syntax_error_becomes_value_error():
    with pytest.raises(ValueError, match="does not compile"):
        render_chat_template("{% for m in messages %}", [{"role": "user", "content": "hi"}])


def test_template_type_error_becomes_value_error():
    with pytest.raises(ValueError, match="TypeError"):
        render_chat_template("{{ messages[0].content + 1 }}", [{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.append({'role': 'user'}) }}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{{ cycler.__init__.__globals__ }}",
])
def test_sandbox_refuses_unsafe_templates(template):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError):
        render_chat_template(template, messages)
    assert messages == [{"role": "user", "content": "hi"}]


def test_text_parts_are_joined_and_extra_keys_pass_through():
    messages = validate_messages([
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ])
    assert [m["content"] for m in messages] == ["one\ntwo", "", "42"]
    assert messages[1]["tool_calls"] == [{"id": "c1"}] and messages[2]["tool_call_id"] == "c1"


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([{"role": "user", "content": "ok"}, "text"], "message 1 is not an object"),
    ([{"role": "user", "content": "ok"}, {"role": "developer", "content": "x"}], "message 1 has role 'developer'"),
    ([{"content": "x"}], "message 0 has role None"),
    ([{"role": "user", "content": 3}], "message 0 has content of type int"),
    ([{"role": "user"}], "message 0 has content of type NoneType"),
    ([{"role": "assistant", "content": None}], "message 0 has content of type NoneType"),
    ([{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     "message 1: content part 0 \\('image_url'\\) is not a text part"),
])
def test_invalid_messages_name_the_index(messages, match):
    with pytest.raises(ValueError, match=match):
        validate_messages(messages)


def test_tools_must_be_objects():
    with pytest.raises(ValueError, match="tools"):
        render_chat_template("{{ tools }}", [{"role": "user", "content": "hi"}], tools=["not an object"])


def test_chatml():
    rendered = render_chat_template(CHATML_TEMPLATE, USER_ASSISTANT)
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
                        "<|im_start|>assistant\n")


def test_llama3():
    rendered = render_chat_template(LLAMA3_TEMPLATE, USER_ASSISTANT[:2], bos_token="<|begin_of_text|>")
    assert rendered == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_llama2():
    rendered = render_chat_template(LLAMA2_TEMPLATE, USER_ASSISTANT, bos_token="<s>", eos_token="</s>")
    assert rendered == "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello. </s><s>[INST] Bye [/INST]"


def test_mistral():
    rendered = render_chat_template(MISTRAL_TEMPLATE, USER_ASSISTANT, bos_token="<s>", eos_token="</s>")
    assert rendered == "<s>[INST] Be brief.\n\nHi [/INST] Hello.</s>[INST] Bye [/INST]"


@pytest.mark.parametrize("template", [LLAMA2_TEMPLATE, MISTRAL_TEMPLATE])
def test_inst_templates_require_alternating_roles(template):
    with pytest.raises(ValueError, match="alternate"):
        render_chat_template(template, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, LLAMA3_TEMPLATE, LLAMA2_TEMPLATE, MISTRAL_TEMPLATE])
def test_builtin_templates_refuse_tools(template):
    with pytest.raises(ValueError, match="does not support tools"):
        render_chat_template(template, [{"role": "user", "content": "a"}], tools=[{"type": "function"}])


@pytest.mark.parametrize("model_type, tokens, bos, expected", [
    ("qwen2", {"<|im_start|>", "<|im_end|>"}, None, CHATML_TEMPLATE),
    ("llama", {"<|start_header_id|>", "<|eot_id|>", "<|begin_of_text|>"}, "<|begin_of_text|>", LLAMA3_TEMPLATE),
    ("mistral", {"<s>", "</s>"}, "<s>", MISTRAL_TEMPLATE),
    (None, {"[INST]", "[/INST]"}, "<s>", MISTRAL_TEMPLATE),
    ("llama", {"<s>", "</s>"}, "<s>", LLAMA2_TEMPLATE),
    ("gpt2", {"<|endoftext|>"}, "<|endoftext|>", None),
])
def test_builtin_template_choice(model_type, tokens, bos, expected):
    assert builtin_template(model_type, tokens, bos) == expected
