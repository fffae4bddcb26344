"""Process lifecycle with short-lived servers of their own: SIGTERM drains and exits cleanly, a dead
child fails requests in flight and stops the server, children exit when the server is killed, and
start-up failures leave nothing behind."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.harness import MODEL, ServerProcess, started_by, wait_gone, wait_metric

pytestmark = pytest.mark.slow

STREAM = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
          "stream": True}


@pytest.fixture
def start(smollm2_artifact, tmp_path):
    started: list[ServerProcess] = []

    def launch(*extra: str) -> ServerProcess:
        started.append(ServerProcess(smollm2_artifact, tmp_path / f"serve{len(started)}.log", *extra, api_key=None))
        return started[-1].wait_healthy()

    yield launch
    for process in started:
        process.proc.kill()
        process.stop()


def wait_status(url: str, status: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(url, timeout=5).status_code != status:
        assert time.monotonic() < deadline, f"{url} never answered {status}"
        time.sleep(0.05)


def test_sigterm_drains_in_flight_refuses_new_and_exits_cleanly(start):
    server = start("--drain-timeout", "120")
    children, ipc_dir = server.child_pids(), server.ipc_dir()
    assert len(children) == 2 and ipc_dir.is_dir()
    events: list[str] = []
    first_token = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=STREAM, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first_token.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first_token.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    wait_status(f"{server.url}/health", 503)
    refused = httpx.post(f"{server.url}/v1/completions", json={**STREAM, "stream": False}, timeout=10)
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
    reader.join(120)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "error" not in chunks[-1] and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(60) == 0
    assert wait_gone(children, 10) == [] and started_by(server.proc.pid) == []
    assert not ipc_dir.exists()


def test_a_dead_scheduler_fails_requests_in_flight_and_stops_the_server(start):
    server = start()
    children = server.child_pids()
    scheduler = next(p for p in children if b"scheduler_process" in Path(f"/proc/{p}/cmdline").read_bytes())
    result: list[httpx.Response] = []
    body = {**STREAM, "stream": False, "max_tokens": 1500}
    request = threading.Thread(target=lambda: result.append(
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)))
    request.start()
    assert wait_metric(server, "kiln_num_requests_running", lambda v: v == 1) == 1
    subprocess.run(["kill", "-KILL", str(scheduler)], check=True)
    request.join(60)
    assert result and result[0].status_code == 500
    assert "scheduler" in result[0].json()["error"]["message"]
    assert server.proc.wait(60) != 0
    assert wait_gone(children, 10) == [] and started_by(server.proc.pid) == []
    assert "the scheduler process exited unexpectedly" in server.log()


def test_children_exit_when_the_server_is_killed(start):
    server = start()
    children, ipc_dir = server.child_pids(), server.ipc_dir()
    server.proc.kill()
    server.proc.wait(10)
    assert wait_gone(children, 10) == [] and started_by(server.proc.pid) == []
    shutil.rmtree(ipc_dir, ignore_errors=True)  # SIGKILL leaves no chance to clean up


def test_a_model_that_cannot_load_fails_start_up_without_leftovers(smollm2_artifact, tmp_path):
    # The KV pool must hold a whole context (2048 tokens): the scheduler refuses to start.
    server = ServerProcess(smollm2_artifact, tmp_path / "serve.log", "--kv-cache-tokens", "512", api_key=None)
    assert server.proc.wait(120) == 1
    assert "raise kv_cache_tokens" in server.log()
    assert wait_gone(started_by(server.proc.pid), 10) == []
    server.stop()


def test_a_missing_model_is_a_one_line_error(tmp_path):
    done = subprocess.run([sys.executable, "-m", "kiln", "serve", str(tmp_path / "nope"), "--device", "cpu"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("kiln: error:")
