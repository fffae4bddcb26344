"""Several ranks, as real worker processes over gloo on loopback, running a tiny compiled Llama: two
ranks give one rank's tokens (and one rank is the model runner itself, no wrapper); a worker that
raises or is killed fails the engine within 5 s with an error naming the rank, leaving no worker
process behind; closing stops the workers with the stop message; and workers end when the core's
process is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.engine import Engine
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.engine_options import EngineOptions
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.scheduler.batch import StepLists
from kiln.runtime.worker.worker import WorkerDied
from tests.server.harness import alive, children_of, wait_gone
from tests.support.hf_models import make_hf_model

PAGE = 4
PROMPTS = [[1, 5, 9, 33, 2, 7, 100], [3, 4], list(range(200, 221)), [42], [7] * 13]
GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
# A bound on failure detection (correctness, not speed): the engine must not wait on a dead rank.
FAILURE_BOUND_S = 5.0


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ranks")
    return compile_model(make_hf_model("llama3", tmp / "src"), tmp / "m.kiln", CompileOptions(
        dtype="fp32", page_size=PAGE, max_batch_tokens=64, max_batch_size=16, max_seq_len=64))


def make_core(artifact, world_size: int, **options) -> EngineCore:
    return EngineCore(str(artifact), EngineOptions(device="cpu", kv_cache_tokens=1024, world_size=world_size,
                                                   **options))


def generate(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    for rid, (prompt, params) in requests.items():
        core.add_request(rid, prompt, params)
    outputs: dict[str, list[int]] = {rid: [] for rid in requests}
    while core.has_work():
        for event in core.step():
            outputs[event.rid].extend(event.token_ids)
    return outputs


def live_workers() -> list[int]:
    """The pids of this process's children that multiprocessing's spawn started and that still run."""
    found = []
    for pid in children_of(os.getpid()):
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes() and alive(pid):
                found.append(pid)
        except OSError:
            continue  # exited while we looked
    return found


def test_two_ranks_give_the_tokens_of_one_rank(artifact):
    # Chunked prefill (8-token steps), prompts of different lengths, mixed steps, and one sampled request.
    requests = {f"r{i}": (prompt, GREEDY) for i, prompt in enumerate(PROMPTS)}
    requests["sampled"] = ([9, 8, 7, 6], SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_new_tokens=8,
                                                         ignore_eos=True))
    one = make_core(artifact, 1, max_batch_tokens=8)
    assert one.worker.forward == one.runner.forward  # one rank: the core calls the runner itself
    expected = generate(one, requests)
    core = make_core(artifact, 2, max_batch_tokens=8)
    try:
        assert len(live_workers()) == 1
        assert generate(core, requests) == expected
    finally:
        core.close()
    assert [p.exitcode for p in core.worker.processes] == [0]  # stopped by the stop message, not killed
    assert live_workers() == []


def test_a_worker_that_raises_fails_the_engine_naming_the_rank(artifact):
    core = make_core(artifact, 2)
    try:
        # A token id beyond the vocabulary: every rank's forward raises on it, rank 0's here.
        bad = StepLists([], token_ids=[10_000], positions=[0], slots=[PAGE], q_start=[0], q_len=[1], kv_len=[1],
                        page_table=[[1]], logits_index=[0])
        with pytest.raises(IndexError):
            core.worker.forward(bad)
        start = time.monotonic()
        with pytest.raises(WorkerDied) as failure:
            while time.monotonic() - start < FAILURE_BOUND_S:
                core.worker.check()
                time.sleep(0.01)
        message = str(failure.value)
        assert "worker rank 1" in message and "exited with code 1" in message and "IndexError" in message
        assert live_workers() == []
        with pytest.raises(WorkerDied):
            core.worker.forward(bad)  # the next step fails before rank 0 runs it
    finally:
        core.close()


def test_a_killed_worker_fails_the_engine_within_5_s(artifact):
    engine = Engine(str(artifact), device="cpu", kv_cache_tokens=1024, world_size=2)
    try:
        worker = engine.core.worker.processes[0]
        stream = engine.stream([1, 5, 9], SamplingParams(temperature=0, max_new_tokens=50, ignore_eos=True))
        next(stream)
        os.kill(worker.pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(WorkerDied, match=rf"worker rank 1 \(pid {worker.pid}\) was killed by SIGKILL"):
            for _ in stream:
                pass
        assert time.monotonic() - killed < FAILURE_BOUND_S
        with pytest.raises(RuntimeError, match="the engine failed: worker rank 1"):
            engine.generate([1, 2, 3], GREEDY)
    finally:
        engine.shutdown()
    assert live_workers() == []


def test_closing_the_engine_stops_its_workers(artifact):
    with Engine(str(artifact), device="cpu", kv_cache_tokens=1024, world_size=2) as engine:
        workers = live_workers()
        assert len(workers) == 1
        assert len(engine.generate([1, 2, 3], GREEDY).token_ids) == GREEDY.max_new_tokens
    assert [p.exitcode for p in engine.core.worker.processes] == [0]
    assert live_workers() == []


CORE_SCRIPT = """
import sys, time
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.engine_options import EngineOptions
core = EngineCore(sys.argv[1], EngineOptions(device="cpu", kv_cache_tokens=1024, world_size=3))
print(*(p.pid for p in core.worker.processes), flush=True)
time.sleep(600)
"""


def test_workers_end_when_the_core_process_is_killed(artifact):
    core = subprocess.Popen([sys.executable, "-c", CORE_SCRIPT, str(artifact)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in core.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(pid) for pid in pids)
    finally:
        core.kill()
        core.wait()
    assert wait_gone(pids, FAILURE_BOUND_S) == []
