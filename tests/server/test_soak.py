"""A short soak: a minute of concurrent mixed requests (chat and completions, streaming or not,
logprobs, stop strings, n > 1, structured output, clients hanging up). After warm-up the resident
memory of the server and its children stays flat, and no file descriptor leaks."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import httpx
import pytest

from tests.server.harness import MODEL, ServerProcess, wait_metric

SOAK_S = 60
CLIENTS = 6
# Growth allowed after warm-up: allocator slack and caches that fill once (token bytes, grammars).
RSS_SLACK_BYTES = 96 * 1024 * 1024


def rss_and_fds(pids: list[int]) -> tuple[int, int]:
    rss = fds = 0
    for pid in pids:
        status = Path(f"/proc/{pid}/status").read_text()
        rss += int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) * 1024
        fds += len(list(Path(f"/proc/{pid}/fd").iterdir()))
    return rss, fds


def mixed_request(rng: random.Random, i: int) -> tuple[str, dict]:
    kind = rng.choice(["chat", "chat_stream", "completion", "completion_stream", "json", "abort"])
    chat = {"model": MODEL, "messages": [{"role": "user", "content": f"Say something about {i}."}],
            "max_tokens": rng.randint(1, 8), "temperature": rng.choice([0, 0.8]), "n": rng.choice([1, 2])}
    completion = {"model": MODEL, "prompt": f"Item {i}:", "max_tokens": rng.randint(1, 8), "logprobs": 2,
                  "stop": ["\n"], "echo": rng.random() < 0.3}
    if kind == "json":
        return "/v1/chat/completions", {**chat, "n": 1, "response_format": {"type": "json_object"}}
    if kind.startswith("chat"):
        return "/v1/chat/completions", {**chat, "stream": kind == "chat_stream" or kind == "abort"}
    return "/v1/completions", {**completion, "stream": kind == "completion_stream",
                               "echo": completion["echo"] and kind == "completion"}


@pytest.mark.slow
def test_memory_flat_and_no_fd_leak_under_mixed_load(smollm2_artifact, tmp_path):
    server = ServerProcess(smollm2_artifact, tmp_path / "serve.log", api_key=None).wait_healthy()
    try:
        pids = [server.proc.pid, *server.child_pids()]

        async def client(c: httpx.AsyncClient, seed: int, until: float) -> None:
            rng = random.Random(seed)
            i = 0
            while time.monotonic() < until:
                path, body = mixed_request(rng, i)
                i += 1
                if body.get("stream"):
                    async with c.stream("POST", path, json=body) as response:
                        assert response.status_code == 200
                        async for _ in response.aiter_lines():
                            if rng.random() < 0.2:
                                break  # hang up mid-stream
                else:
                    response = await c.post(path, json=body)
                    assert response.status_code == 200, response.text

        async def load(seconds: float) -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
                until = time.monotonic() + seconds
                await asyncio.gather(*(client(c, s, until) for s in range(CLIENTS)))

        asyncio.run(load(SOAK_S / 4))  # warm-up: caches, allocator pools, compiled grammars
        wait_metric(server, "kiln_num_requests_running", lambda v: v == 0, timeout=120)
        rss_warm, fds_warm = rss_and_fds(pids)
        asyncio.run(load(SOAK_S))
        wait_metric(server, "kiln_num_requests_running", lambda v: v == 0, timeout=120)
        assert wait_metric(server, "kiln_kv_pages_held", lambda v: v == 0, timeout=60) == 0
        rss_end, fds_end = rss_and_fds(pids)
        assert rss_end - rss_warm < RSS_SLACK_BYTES, (rss_warm, rss_end)
        assert fds_end <= fds_warm + 2, (fds_warm, fds_end)  # +2: a keep-alive socket still closing
    finally:
        assert server.stop() == 0
