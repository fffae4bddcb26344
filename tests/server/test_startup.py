"""Start-up as the README runs it: the model is served under its own name (the README's curl works
as written), a busy port fails before the model loads, and ``kiln chat`` with nothing on stdin
sends nothing; every process's start-up phases reach the log, ``/health`` and ``/metrics``, and
the HTTP and detokenizer processes start without torch, the scheduler without jinja2."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

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


# The phases each process reports (kiln.runtime.startup); on a GPU the scheduler adds kernel_warmup
# and graph_capture.
EXPECTED_PHASES = {
    "http": {"imports", "artifact", "server_imports", "tokenizer", "http_ready"},
    "scheduler": {"spawn", "imports", "artifact_read", "tokenizer", "weights_load", "kernel_load", "kv_pool"},
    "detokenizer": {"spawn", "imports", "tokenizer"},
}


def test_health_and_metrics_report_every_processs_start_up_phases(server, http):
    report = http.get("/health").json()["startup"]
    by_process: dict[str, set[str]] = {}
    for phase in report["phases"]:
        by_process.setdefault(phase["process"], set()).add(phase["name"])
        assert phase["seconds"] >= 0 and 0 <= phase["start"] <= report["seconds"]
    assert by_process == EXPECTED_PHASES
    metrics = http.get("/metrics").text
    assert 'kiln_startup_seconds{phase="weights_load",process="scheduler"}' in metrics
    ready = next(line for line in metrics.splitlines() if line.startswith('kiln_startup_seconds{phase="ready"'))
    assert float(ready.split()[-1]) == pytest.approx(report["seconds"], abs=1e-3)  # the JSON rounds to 4 places
    log = server.log()
    assert "kiln: start-up: ready in" in log  # the summary
    assert "kiln scheduler: start-up: scheduler weights_load" in log and "kiln: start-up: http tokenizer" in log


def test_the_http_and_detokenizer_processes_never_load_torch(server):
    """torch costs a process seconds of start-up; only the scheduler (the engine) needs it."""
    def loads_torch(pid: int) -> bool:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()

    roles = {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in server.child_pids()}
    detokenizer = next(pid for pid, cmdline in roles.items() if b"detokenizer_process" in cmdline)
    scheduler = next(pid for pid, cmdline in roles.items() if b"scheduler_process" in cmdline)
    assert loads_torch(scheduler)  # the check sees torch where it is
    assert not loads_torch(server.proc.pid) and not loads_torch(detokenizer)


def test_the_scheduler_process_imports_no_template_engine():
    """The scheduler loads a tokenizer but renders no chat template: jinja2 (~0.13 s of import) stays
    out of the imports on its start-up's path."""
    probe = "import sys, kiln.server.scheduler_process; print('jinja2' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
