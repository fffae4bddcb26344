"""SGLang's stop extensions through the official ``openai`` client against a real ``kiln serve``
running SmolLM2: ``matched_stop`` in each choice (the stop string, the stop token id, or null) and
``stop_regex`` (generation ends at the first match, cut where it begins, like a stop string)."""

from __future__ import annotations

import openai
import pytest

from kiln.runtime.text.tokenizer import Tokenizer
from tests.server.harness import MODEL

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def chat(client, **kwargs):
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", 24)
    return client.chat.completions.create(model=MODEL, messages=QUESTION, **kwargs)


def matched(choice) -> object:
    return choice.model_extra["matched_stop"]


@pytest.fixture(scope="module")
def answer(client) -> str:
    """The greedy answer, which ends on EOS within 24 tokens: "The capital of France is Paris."..."""
    response = chat(client)
    assert response.choices[0].finish_reason == "stop" and "Paris" in response.choices[0].message.content
    return response.choices[0].message.content


def test_matched_stop_is_the_stop_string(client, answer):
    response = chat(client, stop=["zzz", " is"])
    assert response.choices[0].message.content == answer[:answer.index(" is")]
    assert matched(response.choices[0]) == " is"
    chunks = [c for c in chat(client, stop=" is", stream=True) if c.choices]
    assert [matched(c.choices[0]) for c in chunks if c.choices[0].finish_reason] == [" is"]


def test_matched_stop_is_the_eos_token_id(client, smollm2_dir, answer):
    response = chat(client)
    assert matched(response.choices[0]) in Tokenizer.from_dir(smollm2_dir).eos_token_ids


def test_matched_stop_is_a_stop_token_id_on_completions(client, http):
    prompt = "The capital of France is"
    ids = http.post("/generate", json={"text": prompt, "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}).json()["output_ids"]
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                         extra_body={"stop_token_ids": [ids[1]]})
    assert response.choices[0].finish_reason == "stop" and response.usage.completion_tokens == 2
    assert matched(response.choices[0]) == ids[1]


def test_matched_stop_is_null_at_the_length_limit(client):
    response = chat(client, max_tokens=2)
    assert response.choices[0].finish_reason == "length" and matched(response.choices[0]) is None
    streamed = [c for c in chat(client, max_tokens=2, stream=True) if c.choices and c.choices[0].finish_reason]
    assert [matched(c.choices[0]) for c in streamed] == [None]


def test_stop_regex_ends_generation_and_is_reported(client, answer):
    pattern = r"P[a-z]+s"
    response = chat(client, extra_body={"stop_regex": pattern})
    assert response.choices[0].message.content == answer[:answer.index("Paris")]
    assert response.choices[0].finish_reason == "stop" and matched(response.choices[0]) == pattern
    assert response.usage.completion_tokens < chat(client).usage.completion_tokens
    chunks = [c for c in chat(client, stream=True, extra_body={"stop_regex": ["^zzz", pattern]}) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer[:answer.index("Paris")]
    assert [matched(c.choices[0]) for c in chunks if c.choices[0].finish_reason] == [pattern]


def test_stop_regex_on_completions_and_generate(client, http):
    prompt, pattern = "The capital of France is", r"Par[a-z]+"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    assert "Paris" in full
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                         extra_body={"stop_regex": pattern})
    assert response.choices[0].text == full[:full.index("Paris")] and matched(response.choices[0]) == pattern
    generated = http.post("/generate", json={"text": prompt, "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "stop_regex": pattern}}).json()
    assert generated["text"] == full[:full.index("Paris")]
    assert generated["meta_info"]["finish_reason"] == "stop" and generated["meta_info"]["matched_stop"] == pattern


@pytest.mark.parametrize("stop_regex", ["(", ["ok", "[a-"], ""])
def test_a_bad_stop_regex_is_a_400_naming_it(client, stop_regex):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, max_tokens=2, extra_body={"stop_regex": stop_regex})
    error = caught.value.response.json()["error"]
    assert error["param"] == "stop_regex" and error["code"] == "invalid_value"
    assert "stop_regex" in error["message"]
