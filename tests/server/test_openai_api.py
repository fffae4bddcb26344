"""The OpenAI-compatible API end to end, through the official ``openai`` client against a real
``kiln serve`` running SmolLM2: answers, streaming, stop strings, n, seeds, logprobs, prefix-cache
usage, and the native endpoints."""

from __future__ import annotations

import json
import math

from tests.server.harness import MODEL

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def chat(client, messages=QUESTION, **kwargs):
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", 24)
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def test_greedy_chat_answers_paris(client):
    response = chat(client)
    assert "Paris" in response.choices[0].message.content
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"
    assert response.model == MODEL and response.created > 0
    assert response.choices[0].message.role == "assistant" and response.choices[0].finish_reason == "stop"
    usage = response.usage
    assert usage.prompt_tokens > 10 and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_streamed_deltas_join_to_the_whole_answer(client):
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Name three colors."}]
    whole = chat(client, messages, max_tokens=30)
    chunks = list(chat(client, messages, max_tokens=30, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_max_completion_tokens_and_length_finish(client):
    response = chat(client, max_tokens=None, max_completion_tokens=3)
    assert response.usage.completion_tokens == 3 and response.choices[0].finish_reason == "length"


def test_stop_strings_cut_the_output(client):
    full = chat(client, max_tokens=24).choices[0].message.content
    assert " is " in full
    for stop in (" is", [" is", "zzz"]):
        response = chat(client, max_tokens=24, stop=stop)
        assert response.choices[0].message.content == full[:full.index(" is")]
        assert response.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, max_tokens=24, stop=" is", stream=True)
                       if c.choices)
    assert streamed == full[:full.index(" is")]


def test_n_samples_with_a_seed_are_reproducible(client):
    kwargs = dict(messages=[{"role": "user", "content": "Tell me a word."}], n=2, temperature=1.0, seed=7,
                  max_tokens=8)
    first, again = chat(client, **kwargs), chat(client, **kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert first.usage.completion_tokens == again.usage.completion_tokens >= 2
    streamed = {0: "", 1: ""}
    for c in chat(client, **kwargs, stream=True):
        for choice in c.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert [streamed[0], streamed[1]] == [c.message.content for c in first.choices]


def test_chat_logprobs_are_consistent(client):
    response = chat(client, max_tokens=8, logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode("utf-8", "replace") == entry.token
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert math.isclose(entry.logprob, tops[0], abs_tol=1e-4) and entry.top_logprobs[0].token == entry.token
    text = response.choices[0].message.content
    assert "".join(e.token for e in content).startswith(text)


def test_completions_with_token_ids_lists_and_logprobs(client, http):
    ids = http.post("/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    by_text = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
                                        logprobs=2)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_text.object == "text_completion" and by_text.id.startswith("cmpl-")
    assert by_text.choices[0].text == by_ids.choices[0].text and by_text.choices[0].text
    logprobs = by_text.choices[0].logprobs
    assert "".join(logprobs.tokens) == by_text.choices[0].text
    assert len(logprobs.token_logprobs) == 6 and all(len(t) >= 2 for t in logprobs.top_logprobs)
    both = client.completions.create(model=MODEL, prompt=["Hello", "One, two,"], max_tokens=3, temperature=0, n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == by_text.choices[0].text


def test_repeated_long_prefix_reports_cached_tokens(client):
    system = "You are a careful assistant. " + " ".join(f"Rule {i}: answer briefly and politely." for i in range(20))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi!"}]
    first = chat(client, messages, max_tokens=2)
    second = chat(client, [*messages[:1], {"role": "user", "content": "Hello there!"}], max_tokens=2)
    assert first.usage.prompt_tokens > 150
    assert second.usage.prompt_tokens_details.cached_tokens >= 128


def test_models_health_and_metrics(client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    health = http.get("/health").json()
    assert health["status"] == "ok" and health["startup"]["seconds"] > 0  # the phases: test_startup.py
    assert http.get("/health_generate").json()["status"] == "ok"
    metrics = http.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    for name in ("kiln_requests_total{", "kiln_time_to_first_token_seconds_bucket", "kiln_inter_token_latency_seconds",
                 "kiln_num_requests_running", "kiln_num_requests_waiting", "kiln_kv_cache_usage_ratio",
                 "kiln_prefix_cache_hit_rate", "kiln_prompt_tokens_total", "kiln_generation_tokens_total"):
        assert name in metrics.text
    assert 'kiln_requests_total{endpoint="/v1/chat/completions",status="200"}' in metrics.text


def test_native_generate_tokenize_detokenize(http):
    tokens = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 2048
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "Hello world"}
    chat_tokens = http.post("/tokenize", json={"messages": QUESTION}).json()["tokens"]
    out = http.post("/generate", json={"input_ids": chat_tokens,
                                       "sampling_params": {"max_new_tokens": 12, "temperature": 0}}).json()
    assert "Paris" in out["text"] and out["meta_info"]["completion_tokens"] == len(out["output_ids"])
    with http.stream("POST", "/generate", json={"input_ids": chat_tokens, "stream": True,
                                                "sampling_params": {"max_new_tokens": 12, "temperature": 0}}) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(line) for line in lines[:-1]]
    assert "".join(e["text"] for e in events) == out["text"]
    assert sum((e["output_ids"] for e in events), []) == out["output_ids"]
