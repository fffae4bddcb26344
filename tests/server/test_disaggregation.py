"""Prefill/decode disaggregation with real processes on the CPU: a ``--disaggregation-mode prefill``
server, a ``--disaggregation-mode decode`` server and ``kiln router --pd-disaggregation`` in front.
Prompts of several lengths, sent concurrently through the router, get the plain engine's tokens
(greedy), and a streamed request streams; the router's /tokenize is the servers'; the official ``openai`` client gets the plain engine's chat
answer, whole and streamed; the decode server reuses the handed-over pages (its prefix-cache hits) and the prefill
server's own prefix cache still works (prompts sharing a passage). A dead decode server, then a dead
prefill server, give a clean 503 naming it, not a hang; bad bootstrap fields are a 400."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from kiln import Engine

from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.engine_options import EngineOptions
from kiln.runtime.sampling import SamplingParams
from tests.server.harness import MODEL, ServerProcess, free_port, wait_gone
from tests.support.hf_models import make_hf_model

PASSAGE = list(range(40, 60))
PROMPTS = [[1, 5, 9, 33, 2, 7, 100], [3, 4], [*PASSAGE, 7], [*PASSAGE, 8, 9, 10], list(range(100, 137))]
PARAMS = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def artifact(smollm2_dir, tmp_path_factory) -> Path:
    """A tiny random Llama in SmolLM2's vocabulary, with its tokenizer and chat template."""
    tmp = tmp_path_factory.mktemp("pd")
    source = make_hf_model("llama3", tmp / "src", vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(smollm2_dir / name, source / name)
    return compile_model(source, tmp / "m.kiln", CompileOptions(
        dtype="fp32", page_size=4, max_batch_tokens=64, max_batch_size=16, max_seq_len=64))


def plain_tokens(artifact: Path) -> list[list[int]]:
    core = EngineCore(str(artifact), EngineOptions(device="cpu", kv_cache_tokens=1024))
    for index, prompt in enumerate(PROMPTS):
        core.add_request(str(index), prompt, SamplingParams(**PARAMS))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    while core.has_work():
        for event in core.step():
            tokens[event.rid] += event.token_ids
    return [tokens[str(i)] for i in range(len(PROMPTS))]


def metric_reaches(url: str, name: str, at_least: float) -> bool:
    """Whether the server's metric reaches ``at_least`` within a few seconds (stats are published
    every quarter second, not at once)."""
    deadline = time.monotonic() + 10
    while True:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        value = float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1))
        if value >= at_least or time.monotonic() > deadline:
            return value >= at_least
        time.sleep(0.2)


def test_prefill_and_decode_servers_behind_the_router_answer_as_the_plain_engine(artifact, tmp_path):
    expected = plain_tokens(artifact)
    with Engine(str(artifact), device="cpu", kv_cache_tokens=1024) as engine:
        answer = engine.chat(QUESTION, SamplingParams(temperature=0, max_new_tokens=8)).text
    bootstrap = free_port()
    prefill = ServerProcess(artifact, tmp_path / "prefill.log", "--disaggregation-mode", "prefill",
                            "--disaggregation-bootstrap-port", str(bootstrap), api_key=None)
    decode = ServerProcess(artifact, tmp_path / "decode.log", "--disaggregation-mode", "decode", api_key=None)
    router_port = free_port()
    router_url = f"http://127.0.0.1:{router_port}"
    with open(tmp_path / "router.log", "wb") as router_log:
        router = subprocess.Popen([sys.executable, "-m", "kiln", "router", "--pd-disaggregation", "--prefill",
                                   prefill.url, str(bootstrap), "--decode", decode.url, "--port", str(router_port)],
                                  stdout=router_log, stderr=subprocess.STDOUT)
        try:
            prefill.wait_healthy()
            decode.wait_healthy()
            _wait_router(router_url)

            def generate(prompt: list[int]) -> httpx.Response:
                return httpx.post(f"{router_url}/generate", json={"input_ids": prompt, "sampling_params": PARAMS},
                                  timeout=120)

            first = generate(PROMPTS[2])  # the passage reaches the prefill server's cache first
            with ThreadPoolExecutor(len(PROMPTS) - 1) as pool:
                rest = list(pool.map(generate, PROMPTS[:2] + PROMPTS[3:]))
            replies = [*rest[:2], first, *rest[2:]]
            assert [r.status_code for r in replies] == [200] * len(PROMPTS)
            assert [r.json()["output_ids"] for r in replies] == expected
            # The prefill server reused the passage's whole pages; the decode server the handed-over pages.
            assert metric_reaches(prefill.url, "kiln_prefix_cache_hit_tokens_total", len(PASSAGE))
            assert metric_reaches(decode.url, "kiln_prefix_cache_hit_tokens_total",
                                  sum((len(p) - 1) // 4 * 4 for p in PROMPTS))

            streamed = httpx.post(f"{router_url}/generate", json={"input_ids": PROMPTS[1], "sampling_params": PARAMS,
                                                                   "stream": True}, timeout=120)
            assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
            assert "data: [DONE]" in streamed.text

            text = {"prompt": "What is the capital of France?"}  # /tokenize: the servers' one tokenizer
            tokenized = httpx.post(f"{router_url}/tokenize", json=text, timeout=30)
            assert tokenized.status_code == 200
            assert tokenized.json() == httpx.post(f"{decode.url}/tokenize", json=text, timeout=30).json()

            bad = httpx.post(f"{decode.url}/generate", json={"input_ids": [1, 2], "sampling_params": PARAMS, "bootstrap_room": 5}, timeout=30)
            assert bad.status_code == 400 and "bootstrap_host" in bad.json()["error"]["message"]

            client = openai.OpenAI(base_url=f"{router_url}/v1", api_key="none", max_retries=0, timeout=120)
            reply = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=8)
            assert reply.choices[0].message.content == answer
            chunks = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=8,
                                                    stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer

            decode_children = decode.child_pids()
            decode.proc.kill()
            assert wait_gone(decode_children, 10) == []
            dead = generate(PROMPTS[0])
            assert dead.status_code == 503 and "decode server" in dead.json()["error"]["message"]

            prefill_children = prefill.child_pids()
            prefill.proc.kill()
            assert wait_gone(prefill_children, 10) == []
            started = time.monotonic()
            dead = generate(PROMPTS[0])
            assert dead.status_code == 503 and "prefill server" in dead.json()["error"]["message"]
            assert time.monotonic() - started < 30
        finally:
            router.kill()
            router.wait()
            prefill.proc.kill()
            prefill.stop()
            decode.proc.kill()
            decode.stop()


def _wait_router(url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the router did not become healthy")


@pytest.fixture(scope="module")
def sharded(artifact, tmp_path_factory) -> dict[str, Path]:
    """The same model compiled for tp=2 and for pp=2 (the disaggregated servers refuse both)."""
    tmp = tmp_path_factory.mktemp("pd-sharded")
    options = dict(dtype="fp32", page_size=4, max_batch_tokens=64, max_batch_size=16, max_seq_len=64)
    source = artifact.parent / "src"
    return {"tp2": compile_model(source, tmp / "tp2.kiln", CompileOptions(**options, tp=2)),
            "pp2": compile_model(source, tmp / "pp2.kiln", CompileOptions(**options, pp=2))}


@pytest.mark.parametrize("args, message", [
    (["serve", "{artifact}", "--device", "cpu", "--dp", "2", "--disaggregation-mode", "prefill"],
     "--disaggregation-mode: a prefill or decode server runs one replica; leave --dp at 1"),
    (["serve", "{tp2}", "--device", "cpu", "--disaggregation-mode", "prefill"],
     "--disaggregation-mode: runs on one-rank artifacts (tp=1, pp=1, ep=1) for now; this one runs on 2 ranks "
     "(tp=2, pp=1, ep=1)"),
    (["serve", "{pp2}", "--device", "cpu", "--disaggregation-mode", "decode"],
     "--disaggregation-mode: runs on one-rank artifacts (tp=1, pp=1, ep=1) for now; this one runs on 2 ranks "
     "(tp=1, pp=2, ep=1)"),
    (["serve", "{artifact}", "--device", "cpu", "--world-size", "2", "--disaggregation-mode", "decode"],
     "--disaggregation-mode: runs on one rank for now; leave --world-size at 1, not 2"),
    (["serve", "{artifact}", "--device", "cpu", "--disaggregation-mode", "decode", "--speculative-algorithm", "ngram",
      "--speculative-num-draft-tokens", "4"],
     "--disaggregation-mode: speculative decoding (--speculative-algorithm ngram) is not supported"),
    (["serve", "{artifact}", "--device", "cpu", "--disaggregation-mode", "prefill", "--lora-modules", "mine=/adapter"],
     "--disaggregation-mode: LoRA adapters are not served with disaggregation"),
    (["serve", "{artifact}", "--device", "cpu", "--dp", "2", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:1"],
     "--dp: data-parallel replicas run on one node"),
    (["router", "--pd-disaggregation", "--prefill", "http://a:1", "port", "--decode", "http://b:2"],
     "--prefill: expected URL [BOOTSTRAP_PORT], got http://a:1 port"),
])
def test_unsupported_layouts_are_refused_by_name(artifact, sharded, args, message):
    paths = {"artifact": artifact, **sharded}
    done = subprocess.run([sys.executable, "-m", "kiln", *(a.format(**paths) for a in args)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and f"kiln: error: {message}" in done.stderr


def test_a_prefill_server_whose_bootstrap_port_is_taken_fails_its_start_naming_the_port(artifact, tmp_path):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        prefill = ServerProcess(artifact, tmp_path / "prefill.log", "--disaggregation-mode", "prefill",
                                "--disaggregation-bootstrap-port", str(port), api_key=None)
        try:
            with pytest.raises(RuntimeError, match=f"--disaggregation-bootstrap-port: cannot listen .*:{port}"):
                prefill.wait_healthy()
        finally:
            prefill.stop()
