"""``kiln serve --world-size 2``, and ``kiln serve M --pp 2`` (compiled on first use; serving starts
both stages' ranks) (a real server, a tiny Llama on the CPU): each answers with one rank's tokens, and a worker rank killed while the server is idle makes the server report an error that
names the rank within 5 s, then exit non-zero, leaving no process behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.engine_options import EngineOptions
from kiln.runtime.sampling import SamplingParams
from tests.server.harness import ServerProcess, children_of, wait_gone
from tests.support.hf_models import make_hf_model

pytestmark = pytest.mark.slow

PROMPT = [1, 5, 9, 33, 2, 7, 100]
PARAMS = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
FAILURE_BOUND_S = 5.0


OPTIONS = dict(dtype="fp32", page_size=4, max_batch_tokens=64, max_batch_size=16, max_seq_len=64)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_hf_model("llama3", tmp_path_factory.mktemp("ranks_server") / "src")


@pytest.fixture(scope="module")
def artifact(source):
    return compile_model(source, source.parent / "m.kiln", CompileOptions(**OPTIONS))


def test_a_killed_worker_rank_stops_the_server(artifact, tmp_path):
    check_serving(artifact, artifact, ["--world-size", "2"], tmp_path)


def test_serve_pp2_runs_every_stage_and_a_killed_stage_stops_the_server(artifact, source, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    check_serving(artifact, source, ["--pp", "2", "--dtype", "fp32", "--max-seq-len", "64"], tmp_path)


def check_serving(one_rank: Path, served: Path, args: list[str], tmp_path: Path) -> None:
    """``served`` (with ``args``) answers as ``one_rank`` does; its worker killed, the server ends."""
    core = EngineCore(str(one_rank), EngineOptions(device="cpu", kv_cache_tokens=1024))
    core.add_request("one", PROMPT, SamplingParams(**PARAMS))
    expected = []
    while core.has_work():
        expected += [t for event in core.step() for t in event.token_ids]
    server = ServerProcess(served, tmp_path / "serve.log", *args, api_key=None)
    try:
        server.wait_healthy()
        reply = httpx.post(f"{server.url}/generate", json={"input_ids": PROMPT, "sampling_params": PARAMS},
                           timeout=60)
        assert reply.status_code == 200 and reply.json()["output_ids"] == expected
        scheduler = next(p for p in server.child_pids() if b"scheduler_process" in _cmdline(p))
        workers = [p for p in children_of(scheduler) if b"spawn_main" in _cmdline(p)]
        assert len(workers) == 1
        everything = [*server.child_pids(), *children_of(scheduler)]
        os.kill(workers[0], signal.SIGKILL)
        killed = time.monotonic()
        reported = f"the scheduler failed: WorkerDied: worker rank 1 (pid {workers[0]}) was killed by SIGKILL"
        while reported not in server.log() and time.monotonic() - killed < FAILURE_BOUND_S:
            time.sleep(0.05)
        assert reported in server.log()
        assert server.proc.wait(30) != 0
        assert wait_gone(everything, 10) == []
    finally:
        server.proc.kill()
        server.stop()


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()
