"""Constrained decoding at batch in the engine core: a step's constrained rows are masked from one
bitmask and advanced together, and that gives every request exactly the tokens it gets decoding
alone, where its grammar is filled and advanced as the only row. A tiny random Llama in SmolLM2's
vocabulary (fp32, CPU) with a batch of JSON-schema, regex, EBNF and unconstrained requests, greedy
and seeded sampling: plain steps, overlapped steps (decode buckets: step N+1's masks filled after
step N's tokens are accepted, on one thread or, for three times the batch, on two) and n-gram
speculation (drafts walked through the grammar and rolled back) must all match the requests run one
at a time. (Speculation matches token for token on greedy rows only: its sampled rows follow the
target's distribution through rejection sampling, not plain decoding's draws; they must still follow
their constraints.) Overlapped chains broken by an arrival and an abort while a step is undrawn
leave the others' tokens unchanged and nothing held."""

from __future__ import annotations

import json
import re

import pytest

from kiln.runtime.engine_core import EngineCore
from kiln.runtime.engine_options import EngineOptions
from kiln.runtime.sampling import SamplingParams
from tests.runtime.test_engine_core import assert_no_leaks
from tests.server.harness import tiny_artifact

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"]}
REGEX = r"[a-z]{2,8}( [a-z]{2,8}){1,3}"
EBNF = 'root ::= "(" [1-9] ("+" [1-9]){0,4} ")"'
MAX_NEW = 40


def batch() -> list[tuple[list[int], SamplingParams]]:
    """Prompts with repeats (so n-grams find drafts) and a mix of constraints and sampling modes."""
    prompt = lambda i: [5 + i, 6, 7, 8, 5 + i, 6, 7, 8, 9 + i]  # noqa: E731
    params = [SamplingParams(temperature=0, max_new_tokens=MAX_NEW, json_schema=SCHEMA),
              SamplingParams(temperature=0, max_new_tokens=MAX_NEW, ignore_eos=True),
              SamplingParams(temperature=0, max_new_tokens=MAX_NEW, regex=REGEX),
              SamplingParams(temperature=0.9, seed=11, max_new_tokens=MAX_NEW, json_schema=SCHEMA),
              SamplingParams(temperature=0, max_new_tokens=MAX_NEW, ebnf=EBNF),
              SamplingParams(temperature=0.8, seed=5, max_new_tokens=MAX_NEW, regex=REGEX),
              SamplingParams(temperature=0, max_new_tokens=12, json_schema=SCHEMA),  # cut off mid-object
              SamplingParams(temperature=1.0, seed=3, max_new_tokens=MAX_NEW // 2, ignore_eos=True)]
    return [(prompt(i), p) for i, p in enumerate(params)]


@pytest.fixture(scope="module")
def artifact(smollm2_dir, tmp_path_factory):
    return tiny_artifact(smollm2_dir, tmp_path_factory.mktemp("constraints"))


def generate(artifact, requests, **options) -> tuple[list[tuple[list[int], str]], EngineCore]:
    """Each request's (tokens, finish reason), all run as one batch by a new core."""
    core = EngineCore(str(artifact), EngineOptions(device="cpu", kv_cache_tokens=4096, **options))
    tokens, reasons = {}, {}
    for i, (prompt, params) in enumerate(requests):
        core.add_request(str(i), prompt, params)
        tokens[str(i)] = []
    while core.has_work():
        for event in core.step():
            assert event.error is None, event.error
            tokens[event.rid] += event.token_ids
            if event.finish_reason:
                reasons[event.rid] = event.finish_reason
    return [(tokens[str(i)], reasons[str(i)]) for i in range(len(requests))], core


@pytest.fixture(scope="module")
def one_at_a_time(artifact):
    """The reference: every request decoded alone, its grammar the step's only row."""
    return [generate(artifact, [request])[0][0] for request in batch()]


def assert_constraints_followed(tokenizer, outputs: list[tuple[list[int], str]]) -> None:
    texts = [tokenizer.decode(tokens, skip_special_tokens=True) for tokens, _ in outputs]
    reasons = [reason for _, reason in outputs]
    assert reasons[:6] == ["stop", "length", "stop", "stop", "stop", "stop"] and reasons[6] == "length"
    for i in (0, 3):
        value = json.loads(texts[i])
        assert set(value) == {"name", "age", "tags"} and 0 <= value["age"] <= 120
    assert re.fullmatch(REGEX, texts[2]) and re.fullmatch(REGEX, texts[5])
    assert re.fullmatch(r"\([1-9](\+[1-9]){0,4}\)", texts[4])


def test_outputs_follow_their_constraints(artifact, one_at_a_time):
    core = EngineCore(str(artifact), EngineOptions(device="cpu", kv_cache_tokens=1024))
    assert_constraints_followed(core.tokenizer, one_at_a_time)


@pytest.mark.parametrize("mode", ["plain", "overlapped", "overlapped, 3 grammar threads", "speculative"])
def test_a_mixed_batch_equals_each_request_alone(artifact, one_at_a_time, mode):
    options = {"plain": {},
               "overlapped": dict(decode_buckets=(1, 2, 4, 8), overlap_schedule=True),
               # Three times the batch: 18 constrained rows, filled on two threads (one per 16 rows).
               "overlapped, 3 grammar threads": dict(decode_buckets=(1, 2, 4, 8, 16, 24), overlap_schedule=True,
                                                     grammar_threads=3),
               "speculative": dict(speculative_algorithm="ngram", speculative_num_draft_tokens=4)}[mode]
    copies = 3 if "threads" in mode else 1
    together, core = generate(artifact, batch() * copies, **options)
    one_at_a_time = one_at_a_time * copies
    if mode == "speculative":
        greedy = [i for i, (_, params) in enumerate(batch()) if params.greedy]
        assert [together[i] for i in greedy] == [one_at_a_time[i] for i in greedy]
        assert_constraints_followed(core.tokenizer, together)
        assert core.stats()["spec_accepted_drafts"] > 0
        return
    assert together == one_at_a_time
    if mode == "overlapped":
        assert core.overlapped_steps > 10


def test_overlapped_constrained_chains_break_for_arrivals_and_aborts(artifact, one_at_a_time):
    # Overlapped constrained steps leave a step undrawn (its mask filling on the filler thread) between
    # core steps; a request arriving or aborted then breaks the chain. The others' tokens stay those
    # they get alone, and nothing is left held.
    core = EngineCore(str(artifact), EngineOptions(device="cpu", kv_cache_tokens=4096, decode_buckets=(1, 2, 4, 8),
                                                   overlap_schedule=True))
    requests = batch()
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(requests))}
    for i, (prompt, params) in enumerate(requests[:6]):
        core.add_request(str(i), prompt, params)
    steps = 0
    while core.has_work():
        for event in core.step():
            assert event.error is None, event.error
            tokens[event.rid] += event.token_ids
        steps += 1
        if steps in (6, 12):
            assert core.overlap.undrawn is not None  # the chain breaks with a step undrawn
        if steps == 6:
            for i in (6, 7):
                core.add_request(str(i), *requests[i])
        if steps == 12:
            core.abort("0")
    assert core.overlapped_steps > 10
    for i in range(1, len(requests)):
        assert tokens[str(i)] == one_at_a_time[i][0], f"request {i}"
    assert tokens["0"] == one_at_a_time[0][0][:len(tokens["0"])] and len(tokens["0"]) < len(one_at_a_time[0][0])
    assert_no_leaks(core)


def test_grammar_threads_below_one_are_refused(artifact):
    with pytest.raises(ValueError, match="grammar_threads: must be at least 1, got 0"):
        EngineCore(str(artifact), EngineOptions(device="cpu", kv_cache_tokens=1024, grammar_threads=0))
