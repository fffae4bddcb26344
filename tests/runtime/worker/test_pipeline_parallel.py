"""Pipelined artifacts (``kiln compile --pp P``, with and without ``--tp``) run in real rank processes
over gloo on loopback, against one rank and HF transformers.

Llama-3 (rope scaling), Mistral (sliding window), Qwen2 (qkv bias) and Qwen3 (q/k norms, tied
embeddings: the embedding in stage 0, the lm_head in stage 1), random weights, at pp=2 and at
tp=2 x pp=2: each rank builds its stage's ``PipelineRunner`` and runs the steps rank 0 broadcasts
(``step_wire``, as the engine's workers do): a batch of prompts of different lengths prefilled
together, then greedy decode steps, each step split into two micro-batches that the stages work on
at once, through each stage's paged KV pool. Rank 0 gets the logits back from the last stage and
checks that its greedy tokens equal the one-rank artifact's and its logits are within TOLERANCE of
them, then runs the prompts again against HF's logits at every position.

Then the engine: ``Engine(M, pp=2)`` compiled on first use gives one rank's tokens, as does a
tp=2 x pp=2 artifact (4 ranks) (and, with two GPUs, pp=2 over NCCL); and a killed stage ends the
engine within 5 s naming it.

Tolerance: f32 everywhere. A stage boundary changes nothing in the arithmetic (the hidden state is
sent as it is); tensor parallelism only changes the summation order, a few f32 ulps on logits of
magnitude ~1, as between kiln and HF (tests/models/test_parity_random.py): the same 1e-4 bound.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kiln import Engine, SamplingParams
from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.runtime.artifact import load_artifact
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.engine_options import EngineOptions
from kiln.runtime.worker.executor import Executor
from kiln.runtime.worker.pipeline_runner import PipelineRunner
from kiln.runtime.worker.rank_grid import RankGrid, join_groups
from kiln.runtime.worker.step_wire import receive_step, send_step
from kiln.runtime.worker.worker import WorkerDied
from tests.runtime.worker.test_ranks import FAILURE_BOUND_S, live_workers
from tests.runtime.worker.test_tensor_parallel import DECODE_STEPS, OPTIONS, PROMPTS, TOLERANCE, greedy
from tests.support.hf_models import load_hf, make_hf_model
from tests.support.parity import assert_prefill_and_decode_match
from tests.support.stepping import PagedRun, RunnerRun

MODELS = ("llama3", "mistral_window", "qwen2", "qwen3")
MICRO_BATCHES = 2
NUM_PAGES = 64


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Each kind's random HF checkpoint and its one-rank artifact."""
    tmp = tmp_path_factory.mktemp("pp")
    return {kind: (source := make_hf_model(kind, tmp / kind), compile_model(source, tmp / f"{kind}-1.kiln",
                                                                          CompileOptions(**OPTIONS)))
            for kind in MODELS}


def check_rank(rank: int, tp: int, pp: int, cases: list[tuple[str, str, str]], store_file: str) -> None:
    """One rank: for each (source, one-rank artifact, pipelined artifact), two runs of its stage (the
    one-rank comparison, the HF one), rank 0 leading, the others following its broadcast steps."""
    grid = RankGrid(tp, pp)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=grid.world_size)
    join_groups(grid, rank)
    try:
        for source, one_rank, piped in cases:
            for run_index in range(2):
                runner = PipelineRunner(load_artifact(piped, grid.stage(rank)), "cpu", NUM_PAGES, rank, grid,
                                        MICRO_BATCHES)
                if rank != 0:
                    while (lists := receive_step()) is not None:
                        runner.forward(lists)
                    continue

                def forward(lists):
                    send_step(lists)
                    return runner.forward(lists)

                run = RunnerRun(forward, runner.page_size)
                if run_index == 0:
                    expected_tokens, expected_logits = greedy(PagedRun(Executor(load_artifact(one_rank), "cpu"),
                                                                       NUM_PAGES), DECODE_STEPS)
                    tokens, logits = greedy(run, DECODE_STEPS)
                    assert tokens == expected_tokens, source
                    for got, expected in zip(logits, expected_logits):
                        assert (got - expected).abs().max().item() < TOLERANCE, source
                else:
                    assert_prefill_and_decode_match(run, load_hf(Path(source)), PROMPTS, DECODE_STEPS, TOLERANCE)
                send_step(None)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2)])
def test_every_architecture_matches_one_rank_and_hf(models, tmp_path, tp, pp):
    cases = []
    for kind, (source, one_rank) in models.items():
        piped = compile_model(source, tmp_path / f"{kind}-tp{tp}-pp{pp}.kiln", CompileOptions(**OPTIONS, tp=tp, pp=pp))
        manifest = load_artifact(piped).manifest
        assert manifest["runtime"]["pp"] == pp and len(manifest["weights"]) == tp * pp
        assert [stage["layers"] for stage in manifest["stages"]] == [[0, 1], [1, 2]]
        cases.append((str(source), str(one_rank), str(piped)))
    mp.start_processes(check_rank, args=(tp, pp, cases, str(tmp_path / "store")), nprocs=tp * pp,
                       start_method="spawn")


ENGINE_OPTIONS = dict(dtype="fp32", max_seq_len=64, max_batch_tokens=8, page_size=4, device="cpu",
                      kv_cache_tokens=512)
GREEDY = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2)])
def test_the_engine_compiles_a_pipelined_artifact_on_first_use_and_gives_one_rank_tokens(
        models, tmp_path, monkeypatch, tp, pp):
    """``Engine(M, tp=..., pp=2)``: rank 0 in this process, the others workers; chunked prefill (8-token
    steps) of prompts of different lengths, decoded together."""
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    source, one_rank = models["qwen3"]
    with Engine(str(one_rank), **ENGINE_OPTIONS) as engine:
        expected = [out.token_ids for out in engine.generate(PROMPTS, GREEDY)]
    with Engine(str(source), tp=tp, pp=pp, **ENGINE_OPTIONS) as engine:
        assert load_artifact(engine.artifact_path).runtime["pp"] == pp
        assert len(engine.core.worker.processes) == tp * pp - 1
        assert [out.token_ids for out in engine.generate(PROMPTS, GREEDY)] == expected
    assert [p.exitcode for p in engine.core.worker.processes] == [0] * (tp * pp - 1)
    assert live_workers() == []


def test_a_pipelined_artifact_runs_on_its_own_ranks_only(models, tmp_path):
    source, _ = models["llama3"]
    piped = compile_model(source, tmp_path / "pp2.kiln", CompileOptions(**OPTIONS, pp=2))
    with pytest.raises(ValueError, match=r"pipelined \(2 stages of tp=1\) over 2 ranks and runs on exactly 2, not 3"):
        EngineCore(str(piped), EngineOptions(device="cpu", kv_cache_tokens=512, world_size=3))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_of_two_stages_give_one_gpu_tokens(models, tmp_path, monkeypatch):
    """NCCL between the stages: the hidden states on the pp group, the logits on their own group."""
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    source, _ = models["qwen2"]
    options = dict(ENGINE_OPTIONS, device="cuda", backend="triton")
    with Engine(str(source), **options) as engine:
        expected = [out.token_ids for out in engine.generate(PROMPTS, GREEDY)]
    with Engine(str(source), pp=2, **options) as engine:
        assert str(engine.core.worker.processes[0].name) == "kiln-rank1"
        assert [out.token_ids for out in engine.generate(PROMPTS, GREEDY)] == expected


def test_a_killed_stage_ends_the_engine_within_5_s_naming_it(models, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    source, _ = models["llama3"]
    engine = Engine(str(source), pp=2, **ENGINE_OPTIONS)
    try:
        stage = engine.core.worker.processes[0]
        stream = engine.stream([1, 5, 9], SamplingParams(temperature=0, max_new_tokens=50, ignore_eos=True))
        next(stream)
        os.kill(stage.pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(WorkerDied, match=rf"worker rank 1 \(pid {stage.pid}\) was killed by SIGKILL"):
            for _ in stream:
                pass
        assert time.monotonic() - killed < FAILURE_BOUND_S
    finally:
        engine.shutdown()
    assert live_workers() == []
