"""The speculative step on a random llama3 (f32, CPU) against plain decoding, greedy so outputs
must be identical: penalties, logit_bias and stop token ids applied per drafted position as plain
decoding applies them token by token, n > 1 samples sharing a prompt, a KV pool small enough that
drafts go without pages and requests are retracted; and sampled requests reproducible by seed."""

from __future__ import annotations

import pytest

from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.engine_options import EngineOptions
from kiln.runtime.sampling import SamplingParams
from tests.support.hf_models import make_hf_model

PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 3, 9, 3, 9], [11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11]]
SPEC = dict(speculative_algorithm="ngram", speculative_num_draft_tokens=4)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    directory = tmp_path_factory.mktemp("speculator")
    options = CompileOptions(dtype="fp32", page_size=4, max_batch_tokens=64, max_batch_size=8, max_seq_len=64)
    return compile_model(make_hf_model("llama3", directory / "src"), directory / "m.kiln", options)


def run(artifact, params: list[SamplingParams], kv_cache_tokens: int = 1024, **spec) -> dict:
    core = EngineCore(str(artifact), EngineOptions(device="cpu", kv_cache_tokens=kv_cache_tokens, **spec))
    out: dict = {}
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        core.add_request(str(i), prompt, p)
    while core.has_work():
        for event in core.step():
            out.setdefault((event.rid, event.index), []).extend(event.token_ids)
            if event.finish_reason:
                out[(event.rid, event.index)].append(event.finish_reason)
    return out, core.stats()


def test_penalties_bias_stop_ids_and_samples_match_plain_greedy(artifact):
    params = [SamplingParams(temperature=0, max_new_tokens=20, repetition_penalty=1.3, ignore_eos=True, n=2),
              SamplingParams(temperature=0, max_new_tokens=18, frequency_penalty=0.5, presence_penalty=0.3,
                             logit_bias={3: 2.0, 9: -1.0}, ignore_eos=True),
              SamplingParams(temperature=0, max_new_tokens=25, stop_token_ids=[14], ignore_eos=True)]
    plain, _ = run(artifact, params)
    speculative, stats = run(artifact, params, **SPEC)
    assert speculative == plain
    assert stats["spec_drafted_tokens"] > 0


def test_a_short_pool_drafts_less_and_retracts_as_plain(artifact):
    params = [SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)] * 3
    plain, _ = run(artifact, params, kv_cache_tokens=64)
    speculative, stats = run(artifact, params, kv_cache_tokens=64, **SPEC)
    assert speculative == plain
    assert stats["retractions"] > 0 and stats["kv_pages_held"] == 0


def test_sampled_requests_are_reproducible_by_seed(artifact):
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=20, max_new_tokens=16, seed=7, ignore_eos=True,
                             repetition_penalty=1.1)] * 3
    first, _ = run(artifact, params, **SPEC)
    second, _ = run(artifact, params, **SPEC)
    assert first == second and all(len(tokens) == 17 for tokens in first.values())
