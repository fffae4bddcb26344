"""``kiln serve M --ep 2`` (a real server compiling a tiny random Qwen3-MoE with SmolLM2's tokenizer
on first use, the experts split over two ranks on the CPU): the official ``openai`` client gets the
one-rank engine's tokens, and ``/metrics`` shows the tokens each expert of each sparse layer was
sent, which add up to the tokens the model computed times the router's top-k."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import httpx
import openai
import pytest

from kiln import Engine, SamplingParams
from tests.server.harness import API_KEY, MODEL, ServerProcess
from tests.support.hf_models import CONFIGS, make_hf_model

PROMPT = [1, 17, 300, 4000, 25, 9, 12]
MAX_TOKENS = 6
TOP_K = CONFIGS["qwen3_moe"][2]["num_experts_per_tok"]
EXPERT_LINE = re.compile(r'^kiln_moe_expert_tokens_total\{layer="(\d+)",expert="(\d+)"\} (\d+)$', re.M)
STATS_WAIT_S = 10.0  # the scheduler publishes its stats every 0.25 s while they change


@pytest.fixture(scope="module")
def source(smollm2_dir, tmp_path_factory) -> Path:
    directory = make_hf_model("qwen3_moe", tmp_path_factory.mktemp("ep_serve") / "src", vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(smollm2_dir / name, directory / name)
    return directory


def expert_tokens(server: ServerProcess) -> dict[int, dict[int, int]]:
    text = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=10).text
    loads: dict[int, dict[int, int]] = {}
    for layer, expert, count in EXPERT_LINE.findall(text):
        loads.setdefault(int(layer), {})[int(expert)] = int(count)
    return loads


def test_serve_ep2_answers_as_one_rank_and_shows_tokens_per_expert(source, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    params = SamplingParams(temperature=0, max_new_tokens=MAX_TOKENS, ignore_eos=True)
    with Engine(str(source), device="cpu", kv_cache_tokens=1024, dtype="fp32", backend="torch",
                max_seq_len=256) as engine:
        expected = engine.generate(PROMPT, params)
    server = ServerProcess(source, tmp_path / "serve.log", "--ep", "2", "--dtype", "fp32", "--max-seq-len", "256")
    try:
        server.wait_healthy()
        assert expert_tokens(server) == {0: dict.fromkeys(range(8), 0), 1: dict.fromkeys(range(8), 0)}
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        completion = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=MAX_TOKENS,
                                               extra_body={"ignore_eos": True})
        client.close()
        assert completion.choices[0].text == expected.text
        # Every prompt token and every generated token but the last went through both sparse layers.
        computed = len(PROMPT) + completion.usage.completion_tokens - 1
        deadline = time.monotonic() + STATS_WAIT_S
        while (loads := expert_tokens(server)) and sum(loads[0].values()) < TOP_K * computed \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert {layer: sum(counts.values()) for layer, counts in loads.items()} == {0: TOP_K * computed,
                                                                                   1: TOP_K * computed}
        assert all(count <= computed for counts in loads.values() for count in counts.values())  # top-k distinct
    finally:
        server.stop()
