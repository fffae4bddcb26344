"""The OpenAI surface clients expect, through the official ``openai`` client where it has the call:
``models.retrieve``, ``echo`` + ``logprobs`` on completions (prompt-token logprobs, checked against
HF), ``system_fingerprint``, one streamed chunk per choice, ``/openapi.json`` and ``/docs``.

Log-likelihood tolerance: both sides run SmolLM2 in f32 on the same weights; per-token logprobs
differ by summation order only (~1e-4, as in tests/models/test_parity_smollm2.py), so the sum over
a prompt of N tokens is held to 2e-3 * N.
"""

from __future__ import annotations

import openai
import pytest
import torch

from tests.server.harness import MODEL

TEXT = "The capital of France is Paris, and the capital of Germany is Berlin."


def test_models_retrieve(client):
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_openapi_and_docs(http):
    schema = http.get("/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models/{model_id}"} <= set(schema["paths"])
    docs = http.get("/docs")
    assert docs.status_code == 200 and "openapi.json" in docs.text


def test_system_fingerprint_and_one_chunk_per_choice(client):
    messages = [{"role": "user", "content": "Hi"}]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert response.system_fingerprint and response.system_fingerprint.startswith("kiln-")
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, n=2, stream=True))
    assert all(len(c.choices) <= 1 and c.system_fingerprint == response.system_fingerprint for c in chunks)
    openers = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert openers == [0, 1]


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def hf_prompt_logprobs(hf, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    scores = logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return scores.tolist()


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_reproduce_hf_log_likelihood(client, http, hf_model, max_tokens):
    ids = http.post("/tokenize", json={"prompt": TEXT}).json()["tokens"]
    # What a log-likelihood harness sends: the text, echo, logprobs, no (or one) new token.
    response = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=max_tokens, echo=True, logprobs=0,
                                         temperature=0)
    choice = response.choices[0]
    logprobs = choice.logprobs
    assert "".join(logprobs.tokens[:len(ids)]) == TEXT and choice.text.startswith(TEXT)
    assert len(logprobs.tokens) == len(ids) + max_tokens and logprobs.token_logprobs[0] is None
    ours = logprobs.token_logprobs[1:len(ids)]
    theirs = hf_prompt_logprobs(hf_model, ids)
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 2e-3
    assert abs(sum(ours) - sum(theirs)) < 2e-3 * len(ids)
    assert logprobs.text_offset[:3] == [0, len(logprobs.tokens[0]), len(logprobs.tokens[0]) + len(logprobs.tokens[1])]
    if max_tokens == 0:
        assert choice.text == TEXT and response.usage.completion_tokens == 0


def test_echo_without_logprobs_and_with_token_ids(http):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "echo": True, "temperature": 0}
    text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert text.startswith("Hello") and len(text) > len("Hello")
    ids = http.post("/tokenize", json={"prompt": "Hello"}).json()["tokens"]
    echoed = http.post("/v1/completions", json={**body, "prompt": ids, "max_tokens": 0}).json()
    assert echoed["choices"][0]["text"] == "Hello"
    refused = http.post("/v1/completions", json={**body, "max_tokens": 0, "echo": False}).json()["error"]
    assert refused["param"] == "max_tokens"
