"""``kiln serve --api-server-count 2``: two HTTP processes on one port, one scheduler, real servers on
loopback and the official ``openai`` client.

A tiny model (8 running at once, ``--max-queued-requests 56``) takes 64 concurrent requests spread over
both API servers (``kiln_api_server_requests_total`` shows each served some), every one answered with its
own prompt echoed; the queue limit is the server's (64 streams in flight over both, then either refuses
the next); streams closed by their clients are aborted (nothing stays held); a LoRA adapter loaded
through one API server is listed and served by all, and gone from all once unloaded; neither API
server loads torch, both start while the model loads, and each serves the server's start-up report; SIGTERM drains both and leaves no process. The real SmolLM2 answers the smoke question (Paris) from both API servers,
and killing one API server ends the whole server within 5 s with no process left.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.harness import API_KEY, MODEL, ServerProcess, metrics, started_by, tiny_artifact, wait_gone, wait_metric

RUNNING, QUEUED = 8, 56
OUTPUT_TOKENS = 6
CONNECTIONS = 16  # separate connections: the kernel hashes each to an API server, so all on one is 2**-15 likely


@pytest.fixture(scope="module")
def tiny(smollm2_dir, tmp_path_factory):
    """The tiny model with one LoRA slot, and an adapter for it."""
    from tests.support.lora import make_peft_adapter

    root = tmp_path_factory.mktemp("api_servers")
    artifact = tiny_artifact(smollm2_dir, root, max_seq_len=2048, max_batch_size=RUNNING, max_loras=1,
                             max_lora_rank=8)
    return artifact, make_peft_adapter(root / "src", root / "adapter", rank=8, seed=3)


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    with ServerProcess(tiny[0], tmp_path_factory.mktemp("api_servers_serve") / "serve.log",
                            "--api-server-count", "2", "--max-queued-requests", str(QUEUED), "--drain-timeout", "60") as process:
        yield process


def served_by_each(server: ServerProcess) -> list[float]:
    seen = metrics(server)
    return [seen.get(f'kiln_api_server_requests_total{{api_server="{i}"}}', 0) for i in range(2)]


def fresh_requests(server: ServerProcess, method: str, path: str, count: int = CONNECTIONS,
                   **kwargs) -> list[httpx.Response]:
    """``count`` requests, each on a connection of its own."""
    return [httpx.request(method, f"{server.url}{path}", headers=server.headers, timeout=60, **kwargs)
            for _ in range(count)]


def test_64_concurrent_requests_spread_over_both_api_servers_none_lost(server):
    before = served_by_each(server)

    async def one(client: openai.AsyncOpenAI, i: int):
        prompt = f"Request {i}: count to ten."
        response = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=OUTPUT_TOKENS,
                                                   temperature=0.8, seed=i, echo=True,
                                                   extra_body={"ignore_eos": True})
        return prompt, response

    async def run_all():
        # A connection per request: the kernel spreads them over the API servers.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120,
                                      http_client=openai.DefaultAsyncHttpxClient(limits=limits)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(RUNNING + QUEUED)))

    results = asyncio.run(run_all())
    assert len(results) == 64
    for prompt, response in results:  # each answer is its own request's: its prompt comes back first
        choice = response.choices[0]
        assert choice.text.startswith(prompt) and choice.finish_reason == "length"
        assert response.usage.completion_tokens == OUTPUT_TOKENS
    after = served_by_each(server)
    # Each scrape counts itself once, after its answer: 2 or more are completions.
    assert all(now - then >= 2 for now, then in zip(after, before)), (before, after)
    seen = metrics(server)
    assert seen['kiln_requests_total{endpoint="/v1/completions",status="200"}'] >= 64  # summed over both
    assert seen["kiln_generation_tokens_total"] >= 64 * OUTPUT_TOKENS
    assert seen["kiln_queue_rejections_total"] == 0


def test_no_api_server_process_loads_torch(server):
    """The extra HTTP processes start as light as the launcher (tests/server/test_startup.py)."""
    def loads_torch(pid: int) -> bool:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()

    api_servers = [pid for pid in server.child_pids()
                   if b"kiln.server.api_server_process" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(api_servers) == 1
    assert not loads_torch(server.proc.pid) and not loads_torch(api_servers[0])


def test_the_other_api_servers_start_while_the_model_loads(server):
    """Their imports and tokenizers are off the start-up's path: started before the scheduler loads
    the weights, they wait for the replicas' facts (MODELS)."""
    log = server.log()
    assert log.index("starting 1 more API server processes") < log.index("start-up: scheduler weights_load")


def test_every_api_server_serves_the_servers_start_up_report(server):
    reports = [response.json()["startup"] for response in fresh_requests(server, "GET", "/health")]
    assert all(report == reports[0] for report in reports) and reports[0]["seconds"] > 0
    assert {phase["process"] for phase in reports[0]["phases"]} >= {"http", "scheduler", "detokenizer"}
    for response in fresh_requests(server, "GET", "/metrics", count=4):
        assert 'kiln_startup_seconds{phase="weights_load",process="scheduler"}' in response.text


def test_the_queue_limit_is_the_servers_and_closed_streams_are_aborted(server):
    body = {"model": MODEL, "prompt": "Write a long story.", "max_tokens": 2000, "ignore_eos": True, "stream": True}

    async def fill_then_ask() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=60, limits=limits) as session:
            async def open_stream():
                response = await session.send(session.build_request("POST", "/v1/completions", json=body),
                                              stream=True)
                assert response.status_code == 200
                return response

            # 64 long streams over both API servers fill the running slots and the queue: each API
            # server alone holds fewer than 64, so a per-process limit would admit more.
            streams = await asyncio.gather(*(open_stream() for _ in range(RUNNING + QUEUED)))
            try:
                return await asyncio.gather(*(session.post("/v1/completions", json={**body, "stream": False})
                                              for _ in range(CONNECTIONS)))
            finally:
                for stream in streams:  # hanging up aborts each stream in the API server holding it
                    await stream.aclose()

    refused = asyncio.run(fill_then_ask())
    assert {response.status_code for response in refused} == {503}
    assert all(r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"] == "1" for r in refused)
    assert metrics(server)["kiln_queue_rejections_total"] == CONNECTIONS
    for name in ("kiln_num_requests_running", "kiln_num_requests_waiting", "kiln_kv_pages_held"):
        assert wait_metric(server, name, lambda v: v == 0, timeout=60) == 0, name
    again = fresh_requests(server, "POST", "/v1/completions", 4,
                           json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert [r.status_code for r in again] == [200] * 4


def test_a_lora_adapter_loaded_through_one_api_server_is_every_ones(server, tiny):
    adapter = str(tiny[1])
    before = served_by_each(server)
    loaded = httpx.post(f"{server.url}/v1/load_lora_adapter", headers=server.headers, timeout=60,
                        json={"lora_name": "tuned", "lora_path": adapter})
    assert loaded.status_code == 200, loaded.text
    for response in fresh_requests(server, "GET", "/v1/models"):
        assert [m["id"] for m in response.json()["data"]] == [MODEL, "tuned"]
    completions = fresh_requests(server, "POST", "/v1/completions",
                                 json={"model": "tuned", "prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert {r.status_code for r in completions} == {200}
    assert len({r.json()["choices"][0]["text"] for r in completions}) == 1  # the same adapter everywhere
    assert all(now - then >= 2 for now, then in zip(served_by_each(server), before))

    unloaded = httpx.post(f"{server.url}/v1/unload_lora_adapter", headers=server.headers, timeout=60,
                          json={"lora_name": "tuned"})
    assert unloaded.status_code == 200, unloaded.text
    for response in fresh_requests(server, "GET", "/v1/models"):
        assert [m["id"] for m in response.json()["data"]] == [MODEL]
    gone = fresh_requests(server, "POST", "/v1/completions", json={"model": "tuned", "prompt": "Hi", "max_tokens": 2})
    assert {r.status_code for r in gone} == {404}


def test_sigterm_drains_both_api_servers_and_leaves_no_process(server):
    # The module's last test: it ends the server.
    children = server.child_pids()
    assert len(children) == 3  # the scheduler, the detokenizer and API server 1
    finished: list[str | None] = []
    started = threading.Semaphore(0)

    def stream() -> None:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
        finish, first = None, True
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=server.headers,
                          timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    if first:  # once a stream: SIGTERM waits for all eight to be in flight
                        started.release()
                        first = False
                    finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
        finished.append(finish)

    readers = [threading.Thread(target=stream) for _ in range(8)]
    for reader in readers:
        reader.start()
    for _ in readers:  # every stream has its first tokens (a connection each: both API servers hold some)
        assert started.acquire(timeout=60)
    server.proc.send_signal(signal.SIGTERM)
    for reader in readers:
        reader.join(120)
    assert finished == ["length"] * 8  # every request in flight, in either API server, finished
    assert server.proc.wait(60) == 0
    assert wait_gone(children, 10) == [] and started_by(server.proc.pid) == []


@pytest.fixture(scope="module")
def smol_server(smollm2_artifact, tmp_path_factory):
    process = ServerProcess(smollm2_artifact, tmp_path_factory.mktemp("api_servers_smol") / "serve.log",
                            "--api-server-count", "2")
    try:
        yield process.wait_healthy()
    finally:
        process.proc.kill()
        process.stop()


def test_smollm2_answers_paris_from_both_api_servers(smol_server):
    before = served_by_each(smol_server)

    def ask() -> str:
        with openai.OpenAI(base_url=f"{smol_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300) as client:
            answer = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=10, messages=[
                {"role": "user", "content": "What is the capital of France?"}])
        return answer.choices[0].message.content

    with ThreadPoolExecutor(CONNECTIONS) as pool:  # a client, and so a connection, each
        answers = list(pool.map(lambda _: ask(), range(CONNECTIONS)))
    assert all("Paris" in answer for answer in answers), answers
    # Each scrape counts itself once, after its answer: 2 or more are chat requests.
    assert all(now - then >= 2 for now, then in zip(served_by_each(smol_server), before))


def test_killing_one_api_server_ends_the_server_within_5_s_with_no_orphans(smol_server):
    children = smol_server.child_pids()
    victim = next(pid for pid in children
                  if b"kiln.server.api_server_process" in Path(f"/proc/{pid}/cmdline").read_bytes())
    os.kill(victim, signal.SIGKILL)
    assert smol_server.proc.wait(5) != 0
    assert wait_gone(children, 5) == [] and started_by(smol_server.proc.pid) == []
    assert "the API server 1 process exited unexpectedly (code -9)" in smol_server.log()
