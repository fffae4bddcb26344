"""Uniform verify steps through the decode graphs of ``k`` tokens a sequence (what a GPU captures;
on a CPU the same padded layout runs eagerly): with decode buckets on, every decoding request's
draft is filled to a full chain so the step fits, and greedy outputs stay those of non-speculative
decoding. A random llama3 (f32): its greedy text falls into loops, so the n-gram drafts hit."""

from __future__ import annotations

import json

import pytest

from kiln.artifact_cache import ensure_model_artifacts
from kiln.artifact_format import MANIFEST
from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.engine_options import EngineOptions
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.spec import speculator
from kiln.runtime.spec.verify import row_choices
from tests.support.hf_models import make_hf_model

PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 3], [11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11], [40, 41, 40]]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    directory = tmp_path_factory.mktemp("verify_graphs")
    options = CompileOptions(dtype="fp32", page_size=4, max_batch_tokens=32, max_batch_size=4, max_seq_len=64)
    return compile_model(make_hf_model("llama3", directory / "src"), directory / "m.kiln", options)


def run(core: EngineCore, max_new_tokens: list[int], params: list[dict] | None = None) -> list[list[int]]:
    out = {str(i): [] for i in range(len(PROMPTS))}
    for i, (prompt, count) in enumerate(zip(PROMPTS, max_new_tokens)):
        extra = params[i] if params is not None else {}
        core.add_request(str(i), prompt, SamplingParams(temperature=0, max_new_tokens=count, ignore_eos=True, **extra))
    while core.has_work():
        for event in core.step():
            out[event.rid] += event.token_ids
    return list(out.values())


def test_uniform_verify_steps_run_as_decode_graphs_and_match_plain_decoding(artifact, monkeypatch):
    lengths = [20, 13, 24, 9]
    plain = run(EngineCore(str(artifact), EngineOptions(device="cpu", kv_cache_tokens=512)), lengths)
    core = EngineCore(str(artifact), EngineOptions(device="cpu", kv_cache_tokens=512, decode_buckets=(1, 2, 4),
                                                   prefill_graphs=True, speculative_algorithm="ngram",
                                                   speculative_num_draft_tokens=3))
    graphs = core.runner.verify_graphs
    assert graphs is not None and graphs.k == 4
    verify_steps, scored = [], []
    real_run, real_forward = graphs.run, core.worker.forward
    monkeypatch.setattr(graphs, "run", lambda lists, tokens_from=None: verify_steps.append(len(lists.q_len))
                        or real_run(lists, tokens_from))
    monkeypatch.setattr(core.worker, "forward", lambda lists, tokens_from=None: verify_steps.append(None)
                        or real_forward(lists, tokens_from))
    # Which kind of step (a graph's batch, or None: eager) each scoring of the logits followed.
    monkeypatch.setattr(speculator, "row_choices", lambda *args: scored.append(verify_steps[-1]) or row_choices(*args))
    assert run(core, lengths) == plain
    stats = core.stats()
    assert any(verify_steps) and stats["spec_accepted_drafts"] > 0
    assert stats["kv_pages_held"] == 0
    # Greedy rows with nothing added to their logits take a graph step's argmax: only steps that ran
    # eagerly (a prefill chunk beside the drafts) score their logits.
    assert not any(scored)


def test_a_penalized_request_beside_greedy_ones_has_its_scores_adjusted_in_a_graph_step(artifact, monkeypatch):
    lengths = [20, 13, 24, 9]
    params = [{}, {"repetition_penalty": 1.3}, {}, {"logit_bias": {7: 3.0}}]
    plain = run(EngineCore(str(artifact), EngineOptions(device="cpu", kv_cache_tokens=512)), lengths, params)
    core = EngineCore(str(artifact), EngineOptions(device="cpu", kv_cache_tokens=512, decode_buckets=(1, 2, 4),
                                                   speculative_algorithm="ngram", speculative_num_draft_tokens=3))
    scored = []
    monkeypatch.setattr(speculator, "row_choices", lambda *args: scored.append(1) or row_choices(*args))
    assert run(core, lengths, params) == plain
    assert scored


def test_a_model_compiled_for_speculation_verifies_every_request_of_a_full_batch_in_one_graph(tmp_path, monkeypatch):
    """Compiled on first use with speculation on, the target returns a logits row for each token a
    full batch verifies (4 sequences x 4 tokens), so a step of 4 decoding requests verifies drafts for
    all of them as one graph; an artifact of one row a sequence would leave 3 of them without drafts."""
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    source = make_hf_model("llama3", tmp_path / "src")
    options = CompileOptions(dtype="fp32", page_size=4, max_batch_tokens=32, max_batch_size=4, max_seq_len=64)
    speculative = dict(speculative_algorithm="ngram", speculative_num_draft_tokens=3)
    artifact, _ = ensure_model_artifacts(source, options, speculative)
    assert json.loads((artifact / MANIFEST).read_text())["runtime"]["symbol_bounds"]["N"] == 16
    core = EngineCore(str(artifact), EngineOptions(device="cpu", kv_cache_tokens=512, decode_buckets=(1, 2, 4),
                                                   prefill_graphs=True, **speculative))
    batches = []
    real_run = core.runner.verify_graphs.run
    monkeypatch.setattr(core.runner.verify_graphs, "run", lambda lists, tokens_from=None:
                        batches.append(len(lists.q_len)) or real_run(lists, tokens_from))
    lengths = [20, 13, 24, 9]
    assert run(core, lengths) == run(EngineCore(str(artifact), EngineOptions(device="cpu", kv_cache_tokens=512)),
                                     lengths)
    assert 4 in batches
