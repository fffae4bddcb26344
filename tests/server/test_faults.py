"""Faults on a real server over loopback: fuzzed bodies for every POST route of the OpenAPI schema
(never a 5xx, the server stays up), an abort storm (nothing left held afterwards), and a dead
child process (the server exits within 5 s, non-zero, saying why, leaving no orphan)."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.harness import MODEL, ServerProcess, started_by, wait_gone, wait_metric

# Any JSON, lone surrogates and non-finite numbers included (what a hostile client can send).
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=20), st.sampled_from(["\ud800", "<|im_start|>", "", MODEL]))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                        max_size=4), max_leaves=12)
# Fields that size the work: small values or junk, so an example never asks for a long generation.
SIZES = st.one_of(st.integers(-3, 4), JSON)
SIZED = {"max_tokens", "max_completion_tokens", "max_output_tokens", "max_new_tokens", "n", "best_of"}
POST_ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/generate", "/tokenize", "/detokenize"]


@pytest.fixture(scope="module")
def schema(http) -> dict:
    return http.get("/openapi.json").json()


def body_strategy(schema: dict, path: str) -> st.SearchStrategy:
    """Bodies built from the route's schema: each of its fields present or not, any JSON in it."""
    ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    properties = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"]
    fields = {name: SIZES if name in SIZED else JSON for name in properties if name != "stream"}
    return st.fixed_dictionaries({}, optional={**fields, "stream": st.booleans()})


@pytest.mark.parametrize("path", POST_ROUTES)
def test_fuzzed_bodies_never_get_a_5xx(server, schema, path):
    @settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(body=body_strategy(schema, path))
    def check(body):
        # A valid request's default length could run long on a CPU (the Responses API names it apart).
        size = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
        if size not in body and "/v1/" in path:
            body[size] = 2
        response = httpx.post(f"{server.url}{path}", content=json.dumps(body).encode(), timeout=60,
                              headers={**server.headers, "content-type": "application/json"})
        assert response.status_code < 500, (body, response.text)
        if response.status_code >= 400:
            error = response.json()["error"]
            assert error["code"] and error["message"], response.text

    check()
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_abort_storm_leaves_nothing_held(server):
    rng = random.Random(30)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        leave_after = rng.randint(0, 3)  # events read before hanging up (0: right after the headers)
        body = {"model": MODEL, "prompt": f"Story {i}: once upon a time", "max_tokens": 6, "stream": True,
                "ignore_eos": True, "temperature": rng.choice([0, 1])}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            seen = 0
            async for line in response.aiter_lines():
                if seen >= leave_after:
                    break
                seen += line.startswith("data: ")

    async def storm() -> None:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=300, limits=limits) as c:
            await asyncio.gather(*(one(c, i) for i in range(200)))

    asyncio.run(storm())
    for name in ("kiln_num_requests_running", "kiln_num_requests_waiting", "kiln_kv_pages_held",
                 "kiln_radix_locked_nodes"):
        assert wait_metric(server, name, lambda v: v == 0, timeout=120) == 0, name
    response = httpx.post(f"{server.url}/v1/completions", headers=server.headers, timeout=60,
                          json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0})
    assert response.status_code == 200 and "Paris" in response.json()["choices"][0]["text"]


@pytest.mark.parametrize("child", ["scheduler", "detokenizer"])
def test_a_dead_child_stops_the_server_within_5s(smollm2_artifact, tmp_path, child):
    server = ServerProcess(smollm2_artifact, tmp_path / "serve.log", api_key=None).wait_healthy()
    try:
        children = server.child_pids()
        victim = next(p for p in children if f"{child}_process".encode() in Path(f"/proc/{p}/cmdline").read_bytes())
        subprocess.run(["kill", "-KILL", str(victim)], check=True)
        assert server.proc.wait(5) != 0
        assert f"the {child} process exited unexpectedly" in server.log()
        assert wait_gone(children, 5) == [] and started_by(server.proc.pid) == []
    finally:
        server.proc.kill()
        server.stop()


def test_a_request_that_raises_in_the_engine_fails_alone(smollm2_artifact, tmp_path):
    poison = 31337  # EngineOptions.debug_fail_token_id: a prompt holding it raises inside the core
    server = ServerProcess(smollm2_artifact, tmp_path / "serve.log", "--debug-fail-token-id", str(poison),
                           api_key=None).wait_healthy()
    try:
        def complete(prompt) -> httpx.Response:
            return httpx.post(f"{server.url}/v1/completions", timeout=300, json={
                "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0})

        async def together() -> list[httpx.Response]:
            prompts = ["The capital of France is", [504, poison, 260], "One, two, three,", "Hello"]
            return await asyncio.gather(*(asyncio.to_thread(complete, p) for p in prompts))

        responses = asyncio.run(together())
        failed = responses[1]
        assert failed.status_code == 500 and "injected failure" in failed.json()["error"]["message"]
        assert [r.status_code for i, r in enumerate(responses) if i != 1] == [200, 200, 200]
        assert "Paris" in responses[0].json()["choices"][0]["text"]
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        assert wait_metric(server, "kiln_kv_pages_held", lambda v: v == 0, timeout=60) == 0
    finally:
        assert server.stop() == 0
