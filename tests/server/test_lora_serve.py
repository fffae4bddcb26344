"""LoRA over HTTP on the real SmolLM2 (a real ``kiln serve`` process, the official openai client):
``--lora-modules`` at start, ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` behind the API
key, the adapter chosen by ``model``, ``/v1/models`` listing each adapter with its parent, and the
errors: unknown adapter 404, rank above the maximum 400 naming it. Outputs are HF + PEFT's greedy
text with the adapter merged (f32 both sides)."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.server.harness import API_KEY, MODEL, ServerProcess
from tests.support.hf_models import hf_greedy
from tests.support.lora import load_merged, make_peft_adapter

PROMPT = "The capital of France is"
TOKENS = 8


@pytest.fixture(scope="module")
def adapters(smollm2_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adapters")
    return {"tuned": make_peft_adapter(smollm2_dir, tmp / "tuned", rank=8, alpha=16.0, seed=5),
            "rs": make_peft_adapter(smollm2_dir, tmp / "rs", rank=4, seed=6, use_rslora=True),
            "big": make_peft_adapter(smollm2_dir, tmp / "big", rank=16, seed=7)}


@pytest.fixture(scope="module")
def server(smollm2_dir, adapters, tmp_path_factory):
    from kiln import compile as compile_model

    tmp = tmp_path_factory.mktemp("lora_serve")
    artifact = compile_model(str(smollm2_dir), str(tmp / "smollm2-lora.kiln"), dtype="fp32", backend="torch",
                             max_seq_len=512, max_loras=2, max_lora_rank=8)
    with ServerProcess(artifact, tmp / "serve.log", "--lora-modules", f"tuned={adapters['tuned']}") as process:
        yield process


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _expected(smollm2_dir, adapter) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    with torch.no_grad():
        tokens = hf_greedy(load_merged(smollm2_dir, adapter), tokenizer.encode(PROMPT), TOKENS)
    return tokenizer.decode(tokens)


def _complete(client: openai.OpenAI, model: str) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0).choices[0].text


def test_adapters_load_serve_by_name_and_unload(server, client, adapters, smollm2_dir):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {MODEL, "tuned"} and models["tuned"].model_extra["parent"] == MODEL
    base, tuned = _complete(client, MODEL), _complete(client, "tuned")
    assert base == _expected(smollm2_dir, None)
    assert tuned == _expected(smollm2_dir, adapters["tuned"]) != base

    body = {"lora_name": "rs", "lora_path": str(adapters["rs"])}
    assert httpx.post(f"{server.url}/v1/load_lora_adapter", json=body).status_code == 401  # no API key
    answer = httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, headers=server.headers)
    assert answer.status_code == 200, answer.text
    assert _complete(client, "rs") == _expected(smollm2_dir, adapters["rs"])
    assert {m.id for m in client.models.list().data} == {MODEL, "tuned", "rs"}

    answer = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "rs"}, headers=server.headers)
    assert answer.status_code == 200, answer.text
    with pytest.raises(openai.NotFoundError, match="The model `rs` does not exist"):
        _complete(client, "rs")
    again = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "rs"}, headers=server.headers)
    assert again.status_code == 404 and again.json()["error"]["code"] == "model_not_found"


def test_bad_adapters_are_400s_naming_the_problem(server, adapters):
    answer = httpx.post(f"{server.url}/v1/load_lora_adapter", headers=server.headers,
                        json={"lora_name": "big", "lora_path": str(adapters["big"])})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert "rank 16 is above the maximum LoRA rank 8" in error["message"] and error["param"] == "lora_path"
    taken = httpx.post(f"{server.url}/v1/load_lora_adapter", headers=server.headers,
                       json={"lora_name": "tuned", "lora_path": str(adapters["rs"])})
    assert taken.status_code == 400 and "already loaded" in taken.json()["error"]["message"]
