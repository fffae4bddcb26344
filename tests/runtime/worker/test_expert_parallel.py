"""Expert-parallel artifacts (``kiln compile --ep N``) run in real rank processes over gloo on
loopback, against the one-rank artifact.

Each MoE family, random weights (tests.support.hf_models): Mixtral (top-2 of 8, renormalized, with
a sliding window), Qwen2-MoE (top-4 of 8 unnormalized, a gated shared expert, layer 0 dense) and
Qwen3-MoE (normalized top-3 of 8, q/k norms). At ep=2 (attention, dense MLP and shared expert
replicated; four experts a rank), at ep=2 inside tp=2 (attention, dense MLP and shared expert
tensor-parallel over the same two ranks) and at ep=2 inside tp=4 (four ranks: two expert groups,
each expert's width split over the two ranks of its group): a batch of prompts of different lengths prefilled together,
then greedy decode steps through each rank's paged KV pool. Every rank runs the same steps and checks
that its tokens equal the one-rank artifact's and its logits are within TOLERANCE of them.

Redundant experts (EPLB-style): ``kiln compile --ep 2 --expert-load FILE --redundant-experts 2`` of
Qwen3-MoE, from skewed loads, places copies of the hottest experts of each layer (ten slots, five
a rank), and gives the one rank's tokens too.

Then ``Engine(M, ep=2)``, compiled on first use, gives one rank's tokens.

Tolerance: f32 everywhere. Expert parallelism changes only the summation order (each rank sums its
experts' routing-weighted outputs, then the all_reduce adds the ranks' sums; tp adds its own
row-parallel sums), a few f32 ulps on logits of magnitude ~1, so the tensor-parallel tests' 1e-4
bound (tests/runtime/worker/test_tensor_parallel.py) applies.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from kiln import Engine, SamplingParams
from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.runtime.artifact import load_artifact
from kiln.runtime.worker.executor import Executor
from tests.runtime.worker.test_tensor_parallel import DECODE_STEPS, OPTIONS, PROMPTS, TOLERANCE, greedy
from tests.compiler.test_errors import kiln_cli
from tests.support.hf_models import make_hf_model
from tests.support.stepping import PagedRun

FAMILIES = ("mixtral_window", "qwen2_moe", "qwen3_moe")
LAYOUTS = {2: (dict(ep=2), dict(ep=2, tp=2)), 4: (dict(ep=2, tp=4),)}  # by the ranks they run on


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Each family's random HF checkpoint and its one-rank artifact."""
    tmp = tmp_path_factory.mktemp("ep")
    return {kind: (source := make_hf_model(kind, tmp / kind),
                   compile_model(source, tmp / f"{kind}-1.kiln", CompileOptions(**OPTIONS)))
            for kind in FAMILIES}


def check_rank(rank: int, ranks: int, cases: list[tuple[str, str, str]], store_file: str) -> None:
    """One rank: for each (name, one-rank artifact, sharded artifact), its shard's run against the one rank's."""
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=ranks)
    try:
        for name, one_rank, sharded in cases:
            expected_tokens, expected_logits = greedy(PagedRun(Executor(load_artifact(one_rank), "cpu"), 64),
                                                      DECODE_STEPS)
            tokens, logits = greedy(PagedRun(Executor(load_artifact(sharded), "cpu", rank), 64), DECODE_STEPS)
            assert tokens == expected_tokens, name
            for got, expected in zip(logits, expected_logits):
                assert (got - expected).abs().max().item() < TOLERANCE, name
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("ranks", sorted(LAYOUTS))
def test_every_moe_family_at_ep2_alone_and_inside_tp_gives_one_rank_tokens(models, tmp_path, ranks):
    cases = []
    for kind, (source, one_rank) in models.items():
        for layout in LAYOUTS[ranks]:
            name = f"{kind}-" + "-".join(f"{k}{v}" for k, v in layout.items())
            sharded = compile_model(source, tmp_path / f"{name}.kiln", CompileOptions(**OPTIONS, **layout))
            runtime = load_artifact(sharded).runtime
            assert (runtime["ep"], runtime["tp"], runtime["ranks"]) == (2, layout.get("tp", 1), ranks)
            assert len(load_artifact(sharded).manifest["weights"]) == ranks
            cases.append((name, str(one_rank), str(sharded)))
    if ranks == 2:
        cases.append(("qwen3_moe-ep2-redundant", str(models["qwen3_moe"][1]), str(_redundant(models, tmp_path))))
    mp.start_processes(check_rank, args=(ranks, cases, str(tmp_path / "store")), nprocs=ranks, start_method="spawn")


def _redundant(models, tmp_path: Path) -> Path:
    """Qwen3-MoE at ep=2 with two redundant experts a layer, placed by ``kiln compile`` from skewed loads."""
    loads = tmp_path / "loads.json"
    loads.write_text(json.dumps({"0": [50, 900, 10, 10, 800, 10, 10, 10], "1": [10] * 7 + [700]}))
    out = tmp_path / "redundant.kiln"
    done = kiln_cli("compile", str(models["qwen3_moe"][0]), "-o", str(out), "--dtype", "fp32", "--page-size", "4",
                    "--max-batch-tokens", "64", "--max-seq-len", "64", "--ep", "2", "--expert-load", str(loads),
                    "--redundant-experts", "2")
    assert done.returncode == 0, done.stderr
    placement = dict((layer, tuple(slots)) for layer, slots in
                     load_artifact(out).manifest["options"]["expert_placement"])
    assert placement[0].count(1) == placement[0].count(4) == 2 and placement[1].count(7) == 3
    return out


def test_engine_compiles_an_ep_artifact_on_first_use_and_gives_one_rank_tokens(models, tmp_path, monkeypatch):
    """``Engine(M, ep=2)``: rank 0 in this process, rank 1 a worker; chunked prefill (8-token steps)."""
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    source, one_rank = models["qwen3_moe"]
    options = dict(dtype="fp32", max_seq_len=64, max_batch_tokens=8, page_size=4, device="cpu", kv_cache_tokens=512)
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    with Engine(str(one_rank), **options) as engine:
        expected = [out.token_ids for out in engine.generate(PROMPTS, params)]
    with Engine(str(source), ep=2, **options) as engine:
        assert load_artifact(engine.artifact_path).runtime["ranks"] == 2
        assert len(engine.core.worker.processes) == 1
        assert [out.token_ids for out in engine.generate(PROMPTS, params)] == expected
    assert [p.exitcode for p in engine.core.worker.processes] == [0]
