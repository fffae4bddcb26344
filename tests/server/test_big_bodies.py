"""Bodies near the 8 MiB limit: parsing and tokenizing happen off the event loop, so /health and
small requests are answered while a big one is in flight; too many messages is a 400 naming them."""

from __future__ import annotations

import json
import select
import socket
import time

import httpx
import pytest

from tests.server.harness import MODEL, ServerProcess


@pytest.fixture(scope="module")
def big_server(smollm2_artifact, tmp_path_factory):
    with ServerProcess(smollm2_artifact, tmp_path_factory.mktemp("big") / "serve.log") as process:  # default body limit
        yield process


def test_too_many_messages_is_a_400_naming_messages(big_server):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 200_000}).encode()
    assert 6_000_000 < len(body) < 8 * 1024 * 1024
    response = httpx.post(f"{big_server.url}/v1/chat/completions", content=body, headers=big_server.headers,
                          timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("messages", "too_many_messages") and "4096" in error["message"]


def test_health_answers_while_a_7mb_body_is_in_flight(big_server):
    # One message of 7 MB of words: parsed, rendered and tokenized (a million tokens, seconds of
    # work) before it is refused for the context length; all of that must happen off the event loop.
    words = "hello world " * 600_000
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": words}]}).encode()
    assert len(body) > 7_000_000
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in big_server.headers.items()) + "\r\n").encode()
    with socket.create_connection(("127.0.0.1", big_server.port)) as big:
        big.sendall(head + body)  # returns once the server has read nearly all of it
        time.sleep(0.05)  # a head start for the big one, shorter than its work (~1 s) even on an idle machine
        asked = time.monotonic()
        health = httpx.get(f"{big_server.url}/health", timeout=120)
        health_s = time.monotonic() - asked
        big_pending = not select.select([big], [], [], 0)[0]  # no byte of its answer yet
        answer = b""
        while chunk := big.recv(65536):
            answer += chunk
    assert health.status_code == 200 and big_pending, \
        f"/health took {health_s:.2f} s and the big one had answered: {answer[:200]!r}"
    status_line, _, rest = answer.partition(b"\r\n")
    assert b" 400 " in status_line and json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["param"] == "messages"
