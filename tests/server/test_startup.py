"""Start-up as the README runs it: the model is served under its own name (the README's curl works
as written), a busy port fails before the model loads, and ``kiln chat`` with nothing on stdin
sends nothing."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import httpx
import openai

from tests.server.harness import ServerProcess, started_by, wait_gone

README_NAME = "smollm2-135m-instruct"  # the name in the README's curl example


def test_the_artifact_records_the_models_own_name(smollm2_artifact):
    assert json.loads((smollm2_artifact / "manifest.json").read_text())["model"]["name"] == README_NAME


def test_served_under_its_own_name_so_the_readme_curl_works(smollm2_artifact, tmp_path):
    server = ServerProcess(smollm2_artifact, tmp_path / "serve.log", api_key=None, served_model_name=None)
    try:
        server.wait_healthy()
        # The README's request, as written.
        response = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
            "model": README_NAME, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0, "max_tokens": 8})
        assert response.status_code == 200, response.text
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list()] == [README_NAME]
    finally:
        assert server.stop() == 0


def test_a_busy_port_fails_before_the_model_loads(smollm2_artifact, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        server = ServerProcess(smollm2_artifact, tmp_path / "serve.log", api_key=None, port=busy.getsockname()[1])
        assert server.proc.wait(60) == 1
    log = server.log()
    assert "cannot listen on 127.0.0.1" in log and "--port" in log
    assert "loading the model" not in log  # no child was started
    assert wait_gone(started_by(server.proc.pid), 5) == []
    server.stop()


def test_chat_with_empty_stdin_sends_nothing(smollm2_artifact):
    done = subprocess.run([sys.executable, "-m", "kiln", "chat", str(smollm2_artifact), "--device", "cpu"],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == ""
    assert "no message to send" in done.stderr
