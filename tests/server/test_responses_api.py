"""``POST /v1/responses`` through the official client: text in and out, instructions,
max_output_tokens, streaming events, and 400s for what it does not serve."""

from __future__ import annotations

import openai
import pytest

from tests.server.harness import MODEL

QUESTION = "What is the capital of France?"


def test_create_answers_with_output_text_and_usage(client):
    response = client.responses.create(model=MODEL, input=QUESTION, instructions="Answer in one short sentence.",
                                       max_output_tokens=16, temperature=0)
    assert response.object == "response" and response.id.startswith("resp_")
    assert "Paris" in response.output_text
    assert response.output[0].role == "assistant" and response.output[0].content[0].type == "output_text"
    assert response.usage.input_tokens > 0 and 0 < response.usage.output_tokens <= 16
    assert response.instructions == "Answer in one short sentence."


def test_message_input_and_max_output_tokens(client):
    response = client.responses.create(model=MODEL, temperature=0, max_output_tokens=2, input=[
        {"role": "developer", "content": "You are terse."},
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 2


def test_streaming_events_add_up_to_the_answer(client):
    events = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] == "response.completed" and "response.output_text.done" in kinds
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas and deltas == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_unserved_features_and_bad_values_are_400s(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="hi", tools=[{"type": "web_search"}])
    assert caught.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="hi", max_output_tokens=0)
    assert caught.value.body["param"] == "max_output_tokens"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-4", input="hi")
