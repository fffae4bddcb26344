"""``tp="auto"``: the planner's layout for a model compiled on first use, on GPUs given as hints (the
CPU has none): tiny random Llamas whose weights (f32, 64 tokens of KV) fit one rank in 1 MB, two
tensor-parallel ranks in 0.4 MB; with 3 attention heads (no tp=2) the planner proposes two pipeline
stages instead, which the engine then runs, giving one rank's tokens. The numbers given pass through,
and ``pp="auto"`` without ``tp="auto"`` is refused."""

from __future__ import annotations

import logging

import pytest

from kiln import Engine, SamplingParams
from kiln.planner.auto import AUTO, LayoutHints, parse_count, resolve_layout
from kiln.planner.plan import PlanError
from kiln.runtime.artifact import load_artifact
from tests.support.hf_models import make_hf_model

HINTS = dict(gpus=2, dtype="fp32", max_seq_len=64)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_hf_model("llama3", tmp_path_factory.mktemp("auto") / "llama")


@pytest.fixture(scope="module")
def three_heads(tmp_path_factory):
    return make_hf_model("llama3", tmp_path_factory.mktemp("auto") / "three_heads", hidden_size=48,
                         num_attention_heads=3, num_key_value_heads=1)


def test_given_numbers_pass_through(llama):
    layout = resolve_layout(llama, 2, None, LayoutHints(**HINTS))
    assert (layout.tp, layout.pp, layout.reason) == (2, 1, None)
    assert parse_count("auto", "--tp") == AUTO and parse_count("3", "--pp") == 3
    with pytest.raises(ValueError, match="--tp must be at least 1, got 0"):
        parse_count("0", "--tp")


def test_tp_auto_takes_the_smallest_tp_that_fits_and_logs_why(llama, caplog):
    caplog.set_level(logging.INFO, logger="kiln.planner.auto")
    roomy = resolve_layout(llama, AUTO, None, LayoutHints(gpu_memory_gb=0.001, **HINTS))
    assert (roomy.tp, roomy.pp) == (1, 1)
    tight = resolve_layout(llama, AUTO, None, LayoutHints(gpu_memory_gb=0.0004, **HINTS))
    assert (tight.tp, tight.pp) == (2, 1)
    assert tight.reason.startswith("tp=auto: tp=2, pp=1 for 2 GPU(s) of 0.0004 GB: tp=2 pp=1: the smallest layout")
    assert tight.reason in caplog.messages


def test_a_model_that_fits_nowhere_says_why(llama):
    with pytest.raises(PlanError, match="does not fit on 2 x H100"):
        resolve_layout(llama, AUTO, None, LayoutHints(gpu_memory_gb=0.0002, **HINTS))


def test_pp_auto_needs_tp_auto(llama):
    with pytest.raises(ValueError, match="pp='auto' is chosen with tp by the planner: give tp='auto' too"):
        resolve_layout(llama, 2, AUTO, LayoutHints(**HINTS))


def test_the_planner_proposes_stages_where_tp_does_not_divide_and_the_engine_runs_them(three_heads, tmp_path,
                                                                                       monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    options = dict(dtype="fp32", max_seq_len=64, max_batch_tokens=8, page_size=4, device="cpu", kv_cache_tokens=512)
    params = SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True)
    prompts = [[1, 5, 9, 33, 2, 7, 100], [3, 4], [42]]
    with Engine(str(three_heads), **options) as engine:
        expected = [out.token_ids for out in engine.generate(prompts, params)]
    with Engine(str(three_heads), tp=AUTO, gpus=2, gpu_memory_gb=0.00025, **options) as engine:
        runtime = load_artifact(engine.artifact_path).runtime
        assert (runtime["tp"], runtime["pp"]) == (1, 2)
        assert engine.layout_reason.startswith("tp=auto: tp=1, pp=2 for 2 GPU(s)")
        assert [out.token_ids for out in engine.generate(prompts, params)] == expected
