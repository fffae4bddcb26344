"""Stop rules: the per-sample conditions worked out when a request is added, and the order
``finish_reason`` applies them in (grammar, stop token ids and EOS, stop strings, length)."""

from __future__ import annotations

from kiln.runtime.sampling import SamplingParams
from kiln.runtime.scheduler.request import Request
from kiln.runtime.text.stop_rules import STOP_RULES, StopRules, finish_reason, matched_stop

EOS = 0


def _request(params: SamplingParams, prompt: list[int] | None = None, max_seq_len: int = 64,
             tokenizer=None) -> Request:
    request = Request("r", prompt or [1, 2, 3], params, seed=0)
    request.extras[STOP_RULES] = StopRules(params, request.prompt_ids, {EOS}, max_seq_len, tokenizer)
    return request


def _push(request: Request, token: int) -> str | None:
    request.output_ids.append(token)
    return finish_reason(request, token)


def test_eos_stops_unless_ignored():
    request = _request(SamplingParams(max_new_tokens=5))
    assert _push(request, EOS) == "stop" and matched_stop(request) == EOS
    assert _push(_request(SamplingParams(max_new_tokens=5, ignore_eos=True)), EOS) is None


def test_stop_token_ids_stop_even_with_eos_ignored():
    request = _request(SamplingParams(max_new_tokens=5, ignore_eos=True, stop_token_ids=[7]))
    assert [_push(request, token) for token in (6, 7)] == [None, "stop"]
    assert matched_stop(request) == 7


def test_length_at_max_new_tokens_or_where_the_context_ends():
    request = _request(SamplingParams(max_new_tokens=3))
    assert [_push(request, 5) for _ in range(3)] == [None, None, "length"]
    assert matched_stop(request) is None
    near_the_end = _request(SamplingParams(max_new_tokens=10), prompt=list(range(1, 7)), max_seq_len=8)
    assert near_the_end.extras[STOP_RULES].max_output == 2
    assert [_push(near_the_end, 5) for _ in range(2)] == [None, "length"]


def test_a_stop_token_as_the_last_allowed_token_is_a_stop():
    assert _push(_request(SamplingParams(max_new_tokens=1)), EOS) == "stop"


def test_stop_strings_watch_the_detokenized_text(smollm2):
    params = SamplingParams(max_new_tokens=20, stop=[" world"], ignore_eos=True)
    request = _request(params, prompt=smollm2.encode("Say:", add_special_tokens=False), tokenizer=smollm2)
    tokens = smollm2.encode(" hello world again", add_special_tokens=False)
    reasons = []
    for token in tokens:
        reasons.append(_push(request, token))
        if reasons[-1] is not None:
            break
    assert reasons[-1] == "stop" and set(reasons[:-1]) == {None}
    assert smollm2.decode(tokens[:len(reasons)]).endswith(" world")
    assert _request(SamplingParams(max_new_tokens=5)).extras[STOP_RULES].watch is None


def test_stop_strings_and_regexes_are_what_matched(smollm2):
    prompt = smollm2.encode("Say:", add_special_tokens=False)
    tokens = smollm2.encode(" hello world 2024 again", add_special_tokens=False)
    for params, expected, text_upto in ((SamplingParams(max_new_tokens=20, stop=[" world"]), " world", " hello world"),
                                        (SamplingParams(max_new_tokens=20, stop_regex=[r"\d{4}"]), r"\d{4}",
                                         " hello world 2024")):
        request = _request(params, prompt=prompt, tokenizer=smollm2)
        reasons = []
        for token in tokens:
            reasons.append(_push(request, token))
            if reasons[-1] is not None:
                break
        assert reasons[-1] == "stop" and set(reasons[:-1]) == {None} and matched_stop(request) == expected
        assert smollm2.decode(tokens[:len(reasons)]) == text_upto  # stopped on the token completing the match
