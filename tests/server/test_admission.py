"""No request lost under load, and a full queue refused cleanly: a real ``kiln serve`` of a tiny model
(8 running at once, ``--max-queued-requests 56``: 64 in flight at most) answers 64 concurrent streams
through the official ``openai`` client, every one of them whole; with 64 long streams in flight the
next request gets 503 in OpenAI's error shape with ``Retry-After``, and is served again once they end."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.server.harness import API_KEY, MODEL, ServerProcess, metric, tiny_artifact

RUNNING, QUEUED = 8, 56
OUTPUT_TOKENS = 6


@pytest.fixture(scope="module")
def tiny_server(smollm2_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("admission")
    artifact = tiny_artifact(smollm2_dir, root, max_seq_len=2048, max_batch_size=RUNNING)
    with ServerProcess(artifact, root / "serve.log", "--max-queued-requests", str(QUEUED)) as process:
        yield process


async def _stream(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, int]:
    stream = await client.completions.create(model=MODEL, prompt=f"Request {i}: count to ten.",
                                             max_tokens=OUTPUT_TOKENS, temperature=0.8, seed=i,
                                             extra_body={"ignore_eos": True}, stream=True,
                                             stream_options={"include_usage": True})
    text, finish, tokens = "", None, 0
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return text, finish, tokens


def test_64_concurrent_streams_all_answered(tiny_server):
    async def run_all():
        async with openai.AsyncOpenAI(base_url=f"{tiny_server.url}/v1", api_key=API_KEY, max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(_stream(client, i) for i in range(RUNNING + QUEUED)))

    results = asyncio.run(run_all())
    assert len(results) == 64
    assert [finish for _, finish, _ in results] == ["length"] * 64
    assert [tokens for _, _, tokens in results] == [OUTPUT_TOKENS] * 64
    assert metric(tiny_server, "kiln_queue_rejections_total") == 0


def test_a_full_queue_answers_503_with_retry_after(tiny_server):
    body = {"model": MODEL, "prompt": "Write a long story.", "max_tokens": 2000, "ignore_eos": True,
            "stream": True}

    async def fill_then_ask() -> httpx.Response:
        async with httpx.AsyncClient(base_url=tiny_server.url, headers=tiny_server.headers, timeout=60,
                                     limits=httpx.Limits(max_connections=None)) as session:
            async def open_stream():
                request = session.build_request("POST", "/v1/completions", json=body)
                response = await session.send(request, stream=True)
                assert response.status_code == 200
                return response

            # Long streams fill every running slot and the queue; the server answers each one's headers
            # at once (no stream can finish in the time this takes: 2000 tokens each).
            streams = await asyncio.gather(*(open_stream() for _ in range(RUNNING + QUEUED)))
            try:
                refused = await session.post("/v1/completions", json={**body, "stream": False})
            finally:
                for stream in streams:
                    await stream.aclose()
            return refused

    refused = asyncio.run(fill_then_ask())
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert error["code"] == "queue_full" and error["type"] == "service_unavailable"
    assert "--max-queued-requests" in error["message"] and "56" in error["message"]
    assert metric(tiny_server, "kiln_queue_rejections_total") == 1
    # The official client reads it as a 503 too; once the streams are gone the server admits again.
    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    deadline = time.monotonic() + 30
    while True:
        try:
            reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
            break
        except openai.InternalServerError as exc:  # the aborted streams may take a moment to be noticed
            assert exc.status_code == 503 and time.monotonic() < deadline
            time.sleep(0.2)
    assert reply.choices[0].finish_reason in ("stop", "length")
