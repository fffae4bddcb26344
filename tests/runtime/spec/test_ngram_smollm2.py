"""n-gram speculation on the real SmolLM2-135M-Instruct (fp32, CPU): greedy outputs identical to
non-speculative decoding for a batch (different prompt lengths, a stop string, max_new_tokens ending
mid-draft, logprobs, a JSON schema), the accepted length on repetitive text, and the KV pool whole
after (rejected drafts' pages back, nothing leaked)."""

from __future__ import annotations

import json

import pytest

from kiln.runtime.engine_core import EngineCore
from kiln.runtime.engine_options import EngineOptions
from kiln.runtime.sampling import SamplingParams

SPEC = dict(speculative_algorithm="ngram", speculative_num_draft_tokens=4)
COUNTING = "Count from 1 to 40, separated by commas: 1, 2, 3, 4, 5, 6, 7, 8,"
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def artifact(smollm2_dir, tmp_path_factory):
    from kiln import compile as compile_model

    return compile_model(str(smollm2_dir), str(tmp_path_factory.mktemp("spec") / "smollm2.kiln"),
                         dtype="fp32", backend="torch", max_seq_len=512)


def generate(core: EngineCore, requests: list[tuple[str, SamplingParams]]) -> list[tuple]:
    """Each request's (tokens, finish reason, logprobs), run to the end as one batch."""
    tokens = {str(i): [] for i in range(len(requests))}
    logprobs = {rid: [] for rid in tokens}
    reasons = {}
    for i, (prompt, params) in enumerate(requests):
        core.add_request(str(i), core.tokenizer.encode(prompt), params)
    while core.has_work():
        for event in core.step():
            tokens[event.rid] += event.token_ids
            logprobs[event.rid] += event.logprobs
            if event.finish_reason:
                reasons[event.rid] = event.finish_reason
    return [(tokens[rid], reasons[rid], logprobs[rid]) for rid in tokens]


def core_for(artifact, **spec) -> EngineCore:
    return EngineCore(str(artifact), EngineOptions(device="cpu", kv_cache_tokens=2048, **spec))


def test_greedy_batch_is_identical_to_non_speculative(artifact):
    greedy = dict(temperature=0)
    requests = [
        (COUNTING, SamplingParams(max_new_tokens=20, **greedy)),
        (CODE, SamplingParams(max_new_tokens=16, logprobs=True, top_logprobs=2, **greedy)),
        # Ends mid-draft: drafts are cut to the output budget and the emitted chain at the length.
        (COUNTING + " 9, 10,", SamplingParams(max_new_tokens=7, **greedy)),
        ("Hi", SamplingParams(max_new_tokens=12, **greedy)),
        # A stop string inside accepted drafts: the chain is cut where it appears.
        (COUNTING, SamplingParams(max_new_tokens=20, stop=["12,"], **greedy)),
        (CODE, SamplingParams(max_new_tokens=24, stop=[" takes"], **greedy)),
    ]
    plain = generate(core_for(artifact), requests)
    core = core_for(artifact, **SPEC)
    speculative = generate(core, requests)
    for (tokens, reason, logprobs), (spec_tokens, spec_reason, spec_logprobs) in zip(plain, speculative):
        assert spec_tokens == tokens and spec_reason == reason
        assert [lp.token_id for lp in spec_logprobs] == [lp.token_id for lp in logprobs]
        # Same model rows, computed in a multi-token step rather than one at a time (~1e-5 apart in f32).
        for ours, theirs in zip(spec_logprobs, logprobs):
            assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-3)
            assert [t for t, _ in ours.top] == [t for t, _ in theirs.top]
    assert [r for _, r, _ in plain] == ["length", "length", "length", "length", "stop", "stop"]
    stats = core.stats()
    assert stats["spec_accepted_drafts"] > 0 and stats["spec_drafted_tokens"] > stats["spec_accepted_drafts"]
    # Every page is back in the pool or held by the prefix cache: rejected drafts' pages were freed.
    assert stats["kv_pages_held"] == 0 and core.scheduler.running == []


def test_accepted_length_on_a_list_continuation(artifact):
    """Counting 8..40 drafts itself from the prompt: measured 1.72 tokens per verify step (4 drafts at most);
    the issue asks for more than 1.3."""
    core = core_for(artifact, **SPEC)
    generate(core, [(COUNTING, SamplingParams(temperature=0, max_new_tokens=32))])
    mean = core.stats()["spec_mean_accept_length"]
    assert mean > 1.3, mean


def test_json_schema_requests_keep_speculating(artifact):
    prompt = 'Give a person as JSON, e.g. {"name": "Ann", "age": 30}, {"name": "Bob", "age": 41}:'
    requests = [(prompt, SamplingParams(temperature=0, max_new_tokens=30, json_schema=json.dumps(SCHEMA))),
                (COUNTING, SamplingParams(temperature=0, max_new_tokens=10))]
    plain = generate(core_for(artifact), requests)
    core = core_for(artifact, **SPEC)
    speculative = generate(core, requests)
    assert [(t, r) for t, r, _ in speculative] == [(t, r) for t, r, _ in plain]
    value = json.loads(core.tokenizer.decode(speculative[0][0], skip_special_tokens=True))
    assert set(value) == {"name", "age"}
    assert core.stats()["spec_accepted_drafts"] > 0


def test_engine_keywords_and_usage(artifact):
    from kiln.engine import Engine

    with pytest.raises(ValueError, match="speculative_eagle_topk"):
        Engine(artifact, device="cpu", speculative_algorithm="ngram", speculative_eagle_topk=2)
    with Engine(artifact, device="cpu", kv_cache_tokens=2048, speculative_algorithm="ngram",
                speculative_num_draft_tokens=4) as engine:
        output = engine.generate(COUNTING, SamplingParams(temperature=0, max_new_tokens=16))
    usage = output.usage
    # Every token after the first (the prompt's step) came from a verify step.
    assert usage.spec_verify_ct >= 1 and usage.spec_verify_tokens == usage.completion_tokens - 1
    assert usage.spec_accept_length > 1
