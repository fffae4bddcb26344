"""Tensor-parallel artifacts (``kiln compile --tp N``) run in real rank processes over gloo on
loopback, against one rank and HF transformers.

Every supported architecture (Llama-3 with its rope scaling, and with attention and MLP biases;
Mistral with a sliding window; Qwen2 with qkv bias; Qwen3 with q/k norms and tied embeddings), random
weights, at tp=2 and tp=4 (4 q
heads and 2 KV heads: at tp=4 each KV head is held by two ranks): a batch of prompts of different
lengths prefilled together, then greedy decode steps through each rank's paged KV pool. Every rank
runs the same steps (the all_gather gives each of them all the logits, so all pick the same tokens)
and checks that its tokens equal the one-rank artifact's and its logits are within TOLERANCE of
them; rank 0 also checks them against HF's at every position.

Then the engine on tp artifacts: ``Engine(M, tp=2)`` compiled on first use gives one rank's tokens,
and the real SmolLM2-135M-Instruct at tp=3 answers "What is the capital of France?" as one rank does.

Tolerance: f32 everywhere. Sharding changes only the summation order (each row-parallel GEMM sums
its ranks' partial products in the all_reduce), a few f32 ulps on logits of magnitude ~1, as between
kiln and HF (tests/models/test_parity_random.py), so the same 1e-4 bound applies to both.
"""

from __future__ import annotations

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
from tests.support.hf_models import load_hf, make_hf_model
from tests.support.parity import assert_prefill_and_decode_match
from tests.support.stepping import PagedRun

# Name -> (a kind of tests.support.hf_models.CONFIGS, config overrides). Llama with biases: the
# row-parallel o and down projections' biases are added once, by rank 0.
MODELS = {"llama3": ("llama3", {}), "llama3_biases": ("llama3", dict(attention_bias=True, mlp_bias=True)),
          "mistral_window": ("mistral_window", {}), "qwen2": ("qwen2", {}), "qwen3": ("qwen3", {})}
PROMPTS = [[1, 5, 9, 33, 2, 7, 100], [3, 4], [200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 210], [42]]
DECODE_STEPS = 5
TOLERANCE = 1e-4
OPTIONS = dict(dtype="fp32", page_size=4, max_batch_tokens=64, max_logit_rows=64, max_seq_len=64)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Each kind's random HF checkpoint and its one-rank artifact."""
    tmp = tmp_path_factory.mktemp("tp")
    return {name: (source := make_hf_model(kind, tmp / name, **overrides),
                   compile_model(source, tmp / f"{name}-1.kiln", CompileOptions(**OPTIONS)))
            for name, (kind, overrides) in MODELS.items()}


def greedy(run: PagedRun, steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefills PROMPTS together, then decodes ``steps`` greedy tokens each; the tokens and each step's logits."""
    run.add_sequences(len(PROMPTS))
    logits = [run.step(PROMPTS, all_logits=True)]
    ends = torch.tensor([len(p) for p in PROMPTS]).cumsum(0) - 1
    last = logits[0][ends]
    tokens: list[list[int]] = [[] for _ in PROMPTS]
    for _ in range(steps):
        for seq, row in zip(tokens, last):
            seq.append(int(row.argmax()))
        last = run.step([[seq[-1]] for seq in tokens])
        logits.append(last)
    return tokens, logits


def check_rank(rank: int, tp: int, cases: list[tuple[str, str, str]], store_file: str) -> None:
    """One rank: for each (source, one-rank artifact, tp artifact), its shard's run against both references."""
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=tp)
    try:
        for source, one_rank, sharded in cases:
            expected_tokens, expected_logits = greedy(PagedRun(Executor(load_artifact(one_rank), "cpu"), 64),
                                                      DECODE_STEPS)
            tokens, logits = greedy(PagedRun(Executor(load_artifact(sharded), "cpu", rank), 64), DECODE_STEPS)
            assert tokens == expected_tokens, source
            for got, expected in zip(logits, expected_logits):
                assert (got - expected).abs().max().item() < TOLERANCE, source
            run = PagedRun(Executor(load_artifact(sharded), "cpu", rank), 64)
            if rank == 0:
                assert_prefill_and_decode_match(run, load_hf(Path(source)), PROMPTS, DECODE_STEPS, TOLERANCE)
            else:  # the same steps: the prompts, then decodes of the tokens every rank picks alike
                greedy(run, DECODE_STEPS)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tp", [2, 4])
def test_every_architecture_matches_one_rank_and_hf(models, tmp_path, tp):
    cases = []
    for name, (source, one_rank) in models.items():
        sharded = compile_model(source, tmp_path / f"{name}-{tp}.kiln", CompileOptions(**OPTIONS, tp=tp))
        assert len(load_artifact(sharded).manifest["weights"]) == tp
        cases.append((str(source), str(one_rank), str(sharded)))
    mp.start_processes(check_rank, args=(tp, cases, str(tmp_path / "store")), nprocs=tp, start_method="spawn")


def test_engine_compiles_a_tp_artifact_on_first_use_and_gives_one_rank_tokens(models, tmp_path, monkeypatch):
    """``Engine(M, tp=2)``: rank 0 in this process, rank 1 a worker; chunked prefill (8-token steps) of
    prompts of different lengths, decoded together."""
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    source, one_rank = models["qwen2"]
    options = dict(dtype="fp32", max_seq_len=64, max_batch_tokens=8, page_size=4, device="cpu", kv_cache_tokens=512)
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    with Engine(str(one_rank), **options) as engine:
        expected = [out.token_ids for out in engine.generate(PROMPTS, params)]
    with Engine(str(source), tp=2, **options) as engine:
        assert load_artifact(engine.artifact_path).runtime["tp"] == 2
        assert len(engine.core.worker.processes) == 1
        assert [out.token_ids for out in engine.generate(PROMPTS, params)] == expected
    assert [p.exitcode for p in engine.core.worker.processes] == [0]


def test_a_tp_artifact_runs_on_its_own_ranks_only(models, tmp_path):
    source, _ = models["llama3"]
    sharded = compile_model(source, tmp_path / "tp2.kiln", CompileOptions(**OPTIONS, tp=2))
    with pytest.raises(ValueError, match="tensor-parallel over 2 ranks and runs on exactly 2, not 3"):
        EngineCore(str(sharded), EngineOptions(device="cpu", kv_cache_tokens=512, world_size=3))


def test_smollm2_at_tp3_answers_as_one_rank(smollm2_dir, tmp_path, monkeypatch):
    """The real SmolLM2-135M-Instruct: 9 q heads and 3 KV heads, so 3 q heads and 1 KV head a rank."""
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    question = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0, max_new_tokens=12)
    options = dict(dtype="fp32", max_seq_len=256, max_batch_tokens=64, device="cpu", kv_cache_tokens=512)
    with Engine(str(smollm2_dir), **options) as engine:
        expected = engine.chat(question, params)
    assert "Paris" in expected.text
    with Engine(str(smollm2_dir), tp=3, **options) as engine:
        assert load_artifact(engine.artifact_path).runtime["num_kv_heads"] == 1
        answer = engine.chat(question, params)
    assert answer.token_ids == expected.token_ids and answer.text == expected.text
