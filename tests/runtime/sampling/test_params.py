"""SamplingParams: defaults, normalization and validation messages naming the parameter."""

from __future__ import annotations

import pytest

from kiln.runtime.sampling import SamplingParams


def test_defaults_are_valid():
    params = SamplingParams()
    params.validate(vocab_size=100)
    assert (params.max_new_tokens, params.temperature, params.top_p, params.top_k, params.n) == (128, 1.0, 1.0, -1, 1)
    assert params.stop == [] and params.logit_bias == {} and params.seed is None and not params.greedy


def test_greedy_is_temperature_zero():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-7).greedy
    assert not SamplingParams(temperature=0.01).greedy


def test_openai_spellings_are_normalized():
    params = SamplingParams(stop="###", stop_regex=r"\d+", logit_bias={"5": 1.5, 7: -2})
    assert params.stop == ["###"] and params.stop_regex == [r"\d+"] and params.logit_bias == {5: 1.5, 7: -2}
    params.validate(vocab_size=10)


def test_fields_are_not_shared_between_instances():
    first = SamplingParams()
    first.stop.append("x")
    assert SamplingParams().stop == []


@pytest.mark.parametrize("name, value", [
    ("max_new_tokens", 0), ("max_new_tokens", 1.5), ("max_new_tokens", True),
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -1),
    ("top_k", 0), ("top_k", -2), ("top_k", 2.0),
    ("min_p", -0.01), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("frequency_penalty", 2.5), ("frequency_penalty", -2.01),
    ("presence_penalty", 3), ("presence_penalty", float("inf")),
    ("seed", 1.5), ("seed", "42"),
    ("stop", ["ok", ""]), ("stop", [3]), ("stop", None),
    ("stop_regex", ["("]), ("stop_regex", ["ok", "[a-"]), ("stop_regex", [""]), ("stop_regex", [3]), ("stop_regex", None),
    ("stop_token_ids", [-1]), ("stop_token_ids", [100]), ("stop_token_ids", ["1"]),
    ("ignore_eos", 1), ("logprobs", "yes"), ("skip_special_tokens", None),
    ("top_logprobs", -1), ("top_logprobs", 21),
    ("n", 0), ("n", 2.0),
    ("logit_bias", {100: 1.0}), ("logit_bias", {-1: 1.0}), ("logit_bias", {3: 101}), ("logit_bias", {3: "x"}),
    ("logit_bias", {"word": 1.0}), ("logit_bias", [1, 2]),
    ("json_schema", 42), ("regex", {"a": 1}), ("ebnf", 7),
])
def test_invalid_values_name_the_parameter(name, value):
    params = SamplingParams()
    setattr(params, name, value)
    with pytest.raises(ValueError, match=f"^{name}"):
        params.validate(vocab_size=100)


def test_bounds_that_are_allowed():
    SamplingParams(temperature=0, top_p=1e-6, top_k=1, min_p=1.0, repetition_penalty=0.01, frequency_penalty=-2,
                   presence_penalty=2, top_logprobs=20, logprobs=True, logit_bias={0: -100, 99: 100},
                   stop_token_ids=[0, 99], seed=-5, json_schema={"type": "object"}).validate(vocab_size=100)


def test_token_ids_unbounded_without_vocab_size():
    SamplingParams(logit_bias={10**6: 1.0}, stop_token_ids=[10**6]).validate()


def test_only_one_constraint():
    with pytest.raises(ValueError, match="only one of json_schema, regex, ebnf, structural_tag.*json_schema, regex"):
        SamplingParams(json_schema="{}", regex="a+").validate()
    SamplingParams(regex="a+").validate()
    SamplingParams(ebnf='root ::= "a"').validate()
