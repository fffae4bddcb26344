"""Clients that leave free their KV at once, and many concurrent streams all finish with the pool
back where it started (``kiln_kv_pages_held`` counts pages pinned by running requests: 0 when idle)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.server.harness import API_KEY, MODEL, metric, wait_metric

LONG = {"max_tokens": 1500, "temperature": 0.7, "ignore_eos": True}  # far longer than any test waits


def wait_idle(server) -> None:
    assert wait_metric(server, "kiln_num_requests_running", lambda v: v == 0) == 0
    assert wait_metric(server, "kiln_kv_pages_held", lambda v: v == 0) == 0


def test_disconnect_mid_stream_frees_kv(server):
    wait_idle(server)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}], "stream": True, **LONG}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=server.headers,
                      timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(6):  # the role chunk, a few tokens
            assert next(lines).startswith("data: ") and next(lines) == ""
        assert wait_metric(server, "kiln_kv_pages_held", lambda v: v > 0) > 0  # stats lag a step or two
    # The connection is closed: the request is aborted and its pages come back within moments.
    assert wait_metric(server, "kiln_kv_pages_held", lambda v: v == 0, timeout=10) == 0
    assert metric(server, "kiln_num_requests_running") == 0


def test_disconnect_while_waiting_for_a_whole_response_frees_kv(server):
    wait_idle(server)
    body = {"model": MODEL, "prompt": "Once upon a time", **LONG}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=3)
    assert wait_metric(server, "kiln_kv_pages_held", lambda v: v == 0, timeout=10) == 0
    assert metric(server, "kiln_num_requests_running") == 0


@pytest.mark.slow
def test_concurrent_streams_all_complete(server):
    wait_idle(server)
    total = metric(server, "kiln_kv_pages_total")
    assert metric(server, "kiln_kv_pages_available") == total

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Count from {i} to {i + 5}."}], max_tokens=8 + i % 5,
            temperature=0.8, seed=i, stream=True)
        text, finish = "", None
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        return text, finish

    async def run_all() -> list[tuple[str, str | None]]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(run_all())
    assert all(finish in ("stop", "length") for _, finish in results)
    assert len(results) == 32 and sum(bool(text) for text, _ in results) >= 28
    wait_idle(server)
    assert metric(server, "kiln_kv_pages_available") == total
