"""Structured outputs through the OpenAI API: ``response_format`` json_schema and json_object with
the official client, the regex extension, a bad schema failing only its request with a 400, and a
bad `--grammar-threads` refused before the server starts."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import openai
import pytest

from tests.server.harness import MODEL

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "population_millions": {"type": "number", "minimum": 0, "maximum": 50},
                                           "country": {"enum": ["France", "Spain", "Italy"]}},
          "required": ["city", "population_millions", "country"]}
ASK = [{"role": "user", "content": "Describe the capital of France as JSON."}]


def test_json_schema_response_format(client):
    response = client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
    jsonschema.validate(json.loads(response.choices[0].message.content), SCHEMA)
    assert response.choices[0].finish_reason == "stop"


def test_json_object_response_format_streams(client):
    chunks = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": 'Reply with a JSON object with keys "name" and "color".'}],
        temperature=0, max_tokens=200, stream=True, response_format={"type": "json_object"})
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)


def test_regex_extension_on_completions(client):
    response = client.completions.create(model=MODEL, prompt="The year was", max_tokens=10, temperature=1.0, seed=4,
                                         extra_body={"regex": r" (19|20)\d\d"})
    assert response.choices[0].text in [f" {y}" for y in range(1900, 2100)]


def test_bad_schema_is_a_400_and_others_continue(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=10,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}})
    assert error.value.body["param"] == "response_format"
    assert "json_schema" in error.value.body["message"]
    ok = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=5)
    assert ok.choices[0].message.content


def test_a_bad_grammar_thread_count_is_refused_before_anything_starts(smollm2_artifact):
    result = subprocess.run([sys.executable, "-m", "kiln", "serve", str(smollm2_artifact), "--device", "cpu",
                             "--grammar-threads", "0"], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "--grammar-threads: must be at least 1, got 0" in result.stderr
