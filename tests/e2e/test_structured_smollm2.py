"""Structured outputs through xgrammar with the real SmolLM2 model in ``kiln.Engine``: JSON schemas
(nested objects, arrays, enums, required fields, bounded numbers), regex and EBNF outputs are valid
by construction, mixed constrained and unconstrained batches keep the unconstrained results, and bad
constraints fail only their own request."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kiln import Engine, SamplingParams

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                    "required": ["city"]}},
        "required": ["name", "age", "address"]},
    "colors": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}},
        "required": ["colors"]},
    "measure": {"type": "object", "properties": {
        "value": {"type": "number", "minimum": -10, "maximum": 10}, "unit": {"enum": ["cm", "m"]}},
        "required": ["value", "unit"]},
}
EXPR_GRAMMAR = r'''
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= num | "(" expr ")"
num ::= [1-9] [0-9]?
'''


@pytest.fixture(scope="module")
def engine(smollm2_dir, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_HOME", str(tmp_path_factory.mktemp("home")))
        with Engine(str(smollm2_dir), dtype="fp32", max_seq_len=1024, page_size=16, kv_cache_tokens=16384) as e:
            yield e


def ask(engine, text):
    return engine.chat_prompt_ids([{"role": "user", "content": text}])


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate(engine, name):
    out = engine.generate(ask(engine, f"Give me a {name} as JSON."),
                          SamplingParams(temperature=0.7, seed=3, max_new_tokens=120, json_schema=SCHEMAS[name]))
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), SCHEMAS[name])


def test_regex_and_ebnf(engine):
    pattern = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d)"
    out = engine.generate(ask(engine, "When did it happen?"), SamplingParams(temperature=1.0, seed=1, regex=pattern,
                                                                             max_new_tokens=30))
    assert re.fullmatch(pattern, out.text)
    out = engine.generate(ask(engine, "Write an arithmetic expression."),
                          SamplingParams(temperature=1.0, seed=2, ebnf=EXPR_GRAMMAR, max_new_tokens=40))
    assert re.fullmatch(r"[0-9+\-() ]+", out.text)
    eval(compile(out.text, "<expr>", "eval"), {"__builtins__": {}})  # parses as an arithmetic expression


def test_twenty_mixed_requests(engine):
    names = sorted(SCHEMAS)
    prompts = [ask(engine, f"Question number {i}: tell me something about the number {i}.") for i in range(20)]
    params = [SamplingParams(temperature=0, max_new_tokens=60, json_schema=SCHEMAS[names[i % 3]]) if i % 2 == 0
              else SamplingParams(temperature=0, max_new_tokens=20) for i in range(20)]
    together = engine.generate(prompts, params)
    for i, out in enumerate(together):
        if i % 2 == 0:
            jsonschema.validate(json.loads(out.text), SCHEMAS[names[i % 3]])
        else:
            assert out.token_ids == engine.generate(prompts[i], params[i]).token_ids


def test_json_object(engine):
    out = engine.generate(ask(engine, 'Reply with a JSON object with the keys "name" and "color" for a cat.'),
                          SamplingParams(temperature=0, max_new_tokens=300, json_schema={"type": "object"}))
    assert out.finish_reason == "stop"
    assert isinstance(json.loads(out.text), dict)


def test_bad_constraints_fail_alone(engine):
    good = engine.generate(ask(engine, "Hi"), SamplingParams(temperature=0, max_new_tokens=5))
    for params, message in [(SamplingParams(regex="(unclosed"), "regex"),
                            (SamplingParams(json_schema={"type": "no-such-type"}), "json_schema"),
                            (SamplingParams(ebnf="root ::= missing_rule"), "ebnf")]:
        for _ in range(2):  # the second time comes from the compiled-grammar cache
            with pytest.raises(ValueError, match=message):
                engine.generate(ask(engine, "Hi"), params)
    assert engine.generate(ask(engine, "Hi"), SamplingParams(temperature=0, max_new_tokens=5)).token_ids == \
        good.token_ids


def test_n_samples_each_follow_the_grammar(engine):
    out = engine.generate(ask(engine, "Give me a person as JSON."),
                          SamplingParams(temperature=1.0, seed=9, n=3, max_new_tokens=120, json_schema=SCHEMAS["person"]))
    assert len(out.completions) == 3
    for completion in out.completions:
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), SCHEMAS["person"])


def test_retraction_keeps_constrained_results(engine, smollm2_dir):
    prompts = [ask(engine, f"Describe person {i} as JSON.") for i in range(6)]
    params = SamplingParams(temperature=0, max_new_tokens=100, json_schema=SCHEMAS["person"])
    roomy = [o.text for o in engine.generate(prompts, params)]
    # A pool of one full context (256 tokens) for six requests of ~140 tokens: requests are retracted
    # mid-generation and resume with their grammar state where they were.
    with Engine(str(smollm2_dir), dtype="fp32", max_seq_len=256, page_size=16, kv_cache_tokens=256) as tight:
        outputs = tight.generate(prompts, params)
        assert tight.core.scheduler.num_retractions > 0
    assert [o.text for o in outputs] == roomy
    for text in roomy:
        jsonschema.validate(json.loads(text), SCHEMAS["person"])


def test_overlapped_greedy_steps_keep_constrained_results(engine):
    # With decode buckets (the padded path a GPU captures as graphs) decode steps overlap: step N+1
    # is launched before step N's tokens are read, and a constrained row's mask for N+1 is filled
    # once N's token has been accepted. Greedy and seeded sampled rows, with and without grammars, a
    # stop token, and requests whose grammar completes while others go on: the results must equal
    # the plain step-by-step engine's.
    from kiln.runtime.engine_core import EngineCore
    from kiln.runtime.engine_options import EngineOptions

    prompts = [ask(engine, f"Describe person {i} as JSON.") for i in range(3)] + [ask(engine, "Count to five.")]
    free = engine.generate(prompts[3], SamplingParams(temperature=0, max_new_tokens=12))
    params = [SamplingParams(temperature=0, max_new_tokens=90, json_schema=SCHEMAS["person"]),
              SamplingParams(temperature=0.8, seed=4, max_new_tokens=40, json_schema=SCHEMAS["colors"]),
              SamplingParams(temperature=0, max_new_tokens=30, regex=r"[a-z]{3,8}( [a-z]{3,8}){2,5}"),
              SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=[free.token_ids[6]])]
    expected = [o.token_ids for o in engine.generate(prompts, params)]
    core = EngineCore(str(engine.artifact_path), EngineOptions(device="cpu", kv_cache_tokens=16384,
                                                               decode_buckets=(1, 2, 4), overlap_schedule=True))
    outputs = {f"r{i}": [] for i in range(4)}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        core.add_request(f"r{i}", prompt, p)
    while core.has_work():
        for event in core.step():
            outputs[event.rid].extend(event.token_ids)
    assert core.overlapped_steps > 10
    assert [outputs[f"r{i}"] for i in range(4)] == expected
    jsonschema.validate(json.loads(engine.tokenizer.decode(outputs["r0"])), SCHEMAS["person"])
