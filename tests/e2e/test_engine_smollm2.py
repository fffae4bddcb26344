"""``kiln.Engine`` on the real SmolLM2-135M-Instruct: batched greedy generation equals HF's greedy
output for each prompt alone (with chunked prefill under a small token budget), the chat answer,
stop strings, n > 1, logprobs against HF's log-softmax, streaming and async use."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kiln import Engine, SamplingParams
from tests.support.hf_models import hf_greedy

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "def add(a, b):",
    "Translate to French: good morning",
    "The tallest mountain in the world is",
    "Explain photosynthesis in one sentence.",
    "1, 2, 3, 4,",
]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def engine(smollm2_dir, tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("KILN_HOME", str(tmp_path_factory.mktemp("home")))
    with Engine(str(smollm2_dir), dtype="fp32", max_seq_len=1024, max_batch_tokens=32, page_size=16,
                kv_cache_tokens=8192) as engine:
        yield engine


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def chat_ids(engine: Engine, text: str) -> list[int]:
    return engine.chat_prompt_ids([{"role": "user", "content": text}])


def test_batched_greedy_equals_hf_alone(engine, hf):
    prompts = [chat_ids(engine, p) for p in PROMPTS]
    outputs = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, output in zip(prompts, outputs):
        assert output.token_ids == hf_greedy(hf, prompt, NEW_TOKENS)
        assert output.usage.prompt_tokens == len(prompt) and output.usage.completion_tokens == NEW_TOKENS


def test_chat_answers_paris(engine):
    out = engine.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_new_tokens=30))
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


def test_stop_string_cuts_the_text(engine):
    full = engine.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0, max_new_tokens=30)).text
    out = engine.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_new_tokens=30, stop=["Paris"]))
    assert out.text == full[:full.index("Paris")]
    assert out.finish_reason == "stop" and out.completions[0].stop_string == "Paris"


def test_n_samples(engine):
    out = engine.generate("Tell me a story about a cat.",
                          SamplingParams(temperature=1.0, n=3, seed=7, max_new_tokens=12, ignore_eos=True))
    assert len(out.completions) == 3 and len({tuple(c.token_ids) for c in out.completions}) == 3
    assert out.usage.completion_tokens == 36


def test_logprobs_match_hf_log_softmax(engine, hf):
    prompt = chat_ids(engine, "Name a fruit.")
    out = engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=8, logprobs=True, top_logprobs=3,
                                                 ignore_eos=True))
    ids = prompt + out.token_ids
    with torch.no_grad():
        expected = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    for i, entry in enumerate(out.completions[0].logprobs):
        row = expected[len(prompt) - 1 + i]
        assert entry.token_id == out.token_ids[i]
        assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=2e-3)
        top_ids = [t for t, _ in entry.top]
        assert top_ids == row.topk(3).indices.tolist()


def test_stream_joins_to_the_full_text(engine):
    params = SamplingParams(temperature=0, max_new_tokens=24)
    prompt = engine.apply_chat_template([{"role": "user", "content": "Say hello in three languages."}])
    deltas = list(engine.stream(prompt, params))
    assert "".join(d.text for d in deltas) == engine.generate(prompt, params).text
    assert deltas[-1].finish_reason is not None and deltas[-1].usage is not None


def test_async_generate_and_stream(engine):
    async def main():
        prompt = engine.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
        params = SamplingParams(temperature=0, max_new_tokens=12)
        whole, pieces = await asyncio.gather(engine.async_generate(prompt, params),
                                             _collect(engine.async_stream(prompt, params)))
        return whole.text, "".join(pieces)

    whole, streamed = asyncio.run(main())
    assert whole == streamed and whole


async def _collect(stream):
    return [delta.text async for delta in stream]


def test_bad_request_raises_and_engine_keeps_serving(engine):
    with pytest.raises(ValueError, match="top_p"):
        engine.generate("hi", SamplingParams(top_p=1.5))
    with pytest.raises(ValueError, match="exceeds the context length"):
        engine.generate("hi", SamplingParams(max_new_tokens=5000))
    assert engine.generate("hi", SamplingParams(temperature=0, max_new_tokens=3)).completions[0].token_ids
