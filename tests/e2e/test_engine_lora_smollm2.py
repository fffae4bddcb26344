"""``kiln.Engine`` with LoRA adapters on the real SmolLM2-135M-Instruct: random PEFT adapters
(non-zero B, ranks 8 and 4, one rsLoRA) give HF + PEFT's greedy tokens with the adapter merged, and
logprobs within 2e-3 (both in f32; kiln adds the update after each GEMM where HF merged it into W,
and over 30 layers the summation orders differ by ~1e-4, as the base model's own test allows);
adapters loaded and unloaded at run time, chosen per request in one batch.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from kiln import Engine, SamplingParams
from tests.support.hf_models import hf_greedy
from tests.support.lora import load_merged, make_peft_adapter

PROMPTS = ["The capital of France is", "def add(a, b):"]
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)


@pytest.fixture(scope="module")
def adapters(smollm2_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adapters")
    return {"tuned": make_peft_adapter(smollm2_dir, tmp / "tuned", rank=8, alpha=16.0, seed=5),
            "rs": make_peft_adapter(smollm2_dir, tmp / "rs", rank=4, alpha=4.0, seed=6, use_rslora=True,
                                    targets=("q_proj", "k_proj", "v_proj", "o_proj", "down_proj"))}


@pytest.fixture(scope="module")
def engine(smollm2_dir, adapters, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_HOME", str(tmp_path_factory.mktemp("home")))
        with Engine(str(smollm2_dir), dtype="fp32", max_seq_len=256, max_batch_tokens=64, kv_cache_tokens=4096,
                    lora_modules={"tuned": str(adapters["tuned"])}, max_loras=2, max_lora_rank=8) as engine:
            yield engine


def _reference(smollm2_dir, adapter, prompts_ids):
    hf = load_merged(smollm2_dir, adapter)
    results = []
    for ids in prompts_ids:
        tokens = hf_greedy(hf, ids, NEW_TOKENS)
        with torch.no_grad():
            logits = hf(torch.tensor([ids + tokens])).logits[0, len(ids) - 1:-1].float()
        results.append((tokens, logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()))
    return results


def test_adapters_match_hf_with_peft_merged_in_one_mixed_batch(engine, smollm2_dir, adapters):
    engine.load_lora("rs", adapters["rs"])
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    names = (None, "tuned", "rs")

    async def all_at_once():
        return await asyncio.gather(*(engine.async_generate(i, GREEDY, lora=name) for name in names for i in ids))

    outputs = iter(asyncio.run(all_at_once()))
    for name in names:
        for tokens, logprobs in _reference(smollm2_dir, adapters[name] if name else None, ids):
            out = next(outputs)
            assert list(out.token_ids) == tokens, name
            assert [lp.logprob for lp in out.completions[0].logprobs] == pytest.approx(logprobs, abs=2e-3)
    engine.unload_lora("rs")
    with pytest.raises(LookupError, match="'rs' does not exist"):
        engine.generate(PROMPTS[0], GREEDY, lora="rs")


def test_chat_and_stream_take_the_adapter_by_name(engine, smollm2_dir, adapters):
    messages = [{"role": "user", "content": "Name a color."}]
    chat = engine.chat(messages, dict(temperature=0, max_new_tokens=6), lora="tuned")
    streamed = "".join(d.text for d in engine.stream(engine.chat_prompt_ids(messages),
                                                     dict(temperature=0, max_new_tokens=6), lora="tuned"))
    base = engine.chat(messages, dict(temperature=0, max_new_tokens=6))
    assert streamed == chat.text and chat.text != base.text
