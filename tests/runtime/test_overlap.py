"""Overlapped decoding (kiln.runtime.overlap) on the engine core's tiny random Llama-3: each decode step
launched before the previous one's tokens are read gives exactly the plain engine's results, through
arrivals, stops, aborts, reordered rows and sampling on the device."""

from __future__ import annotations

import pytest

from kiln.runtime.sampling import SamplingParams
from kiln.runtime.scheduler.request import PENDING
from tests.runtime.test_engine_core import GREEDY, PROMPTS, assert_no_leaks, make_core


def test_overlapped_decode_steps_give_the_same_results(tiny_llama, tiny_llama_greedy):
    # Each decode step is launched before the previous one's tokens are read; requests arrive,
    # finish (by length and by a stop token) and are aborted in the middle of such chains.
    plain = make_core(tiny_llama)
    overlapped = make_core(tiny_llama, decode_buckets=(1, 2, 4, 8), overlap_schedule=True)
    stop_at = tiny_llama_greedy(PROMPTS[1])[4]
    requests = {
        "a": (PROMPTS[0], GREEDY),
        "b": (PROMPTS[1], SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=[stop_at])),
        "c": (PROMPTS[2], SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)),
    }
    late = {"d": (PROMPTS[3], GREEDY), "e": (PROMPTS[4], GREEDY)}
    results = []
    for core in (plain, overlapped):
        outputs = {rid: [] for rid in [*requests, *late, "gone"]}
        for rid, (prompt, params) in requests.items():
            core.add_request(rid, prompt, params)
        core.add_request("gone", PROMPTS[5], GREEDY)
        steps = 0
        while core.has_work():
            for event in core.step():
                outputs[event.rid].extend(event.token_ids)
            steps += 1
            if steps == 5:
                for rid, (prompt, params) in late.items():
                    core.add_request(rid, prompt, params)
            if steps == 8:
                core.abort("gone")
        results.append(outputs)
    assert overlapped.overlapped_steps > 5
    plain_out, overlapped_out = results
    for rid in [*requests, *late]:
        assert overlapped_out[rid] == plain_out[rid], rid
    expected_b = tiny_llama_greedy(PROMPTS[1])
    assert overlapped_out["b"] == expected_b[:expected_b.index(stop_at) + 1]
    assert overlapped_out["a"] == tiny_llama_greedy(PROMPTS[0])
    assert_no_leaks(overlapped)


def test_overlapped_step_takes_the_in_flight_tokens_in_the_schedulers_row_order(tiny_llama, tiny_llama_greedy):
    # The scheduler usually keeps the in-flight step's row order; when it does not (reversed by hand
    # here), the follow-up step gathers each row's input id from the in-flight tokens.
    core = make_core(tiny_llama, decode_buckets=(1, 2, 4, 8), overlap_schedule=True)
    prompts = {f"r{i}": prompt for i, prompt in enumerate(PROMPTS[:3])}
    for rid, prompt in prompts.items():
        core.add_request(rid, prompt, GREEDY)
    outputs = {rid: [] for rid in prompts}
    reversed_at = None
    while core.has_work():
        for event in core.step():
            outputs[event.rid].extend(event.token_ids)
        if reversed_at is None and core.overlap.inflight is not None and core.overlapped_steps >= 2:
            core.scheduler.running.reverse()
            reversed_at = core.overlapped_steps
    assert reversed_at is not None and core.overlapped_steps > reversed_at
    for rid, prompt in prompts.items():
        assert outputs[rid] == tiny_llama_greedy(prompt), rid
    assert_no_leaks(core)


@pytest.mark.parametrize("abort_after", [4, 5, 6, 7])
def test_abort_during_overlap_never_caches_a_pending_slot(tiny_llama, abort_after):
    # Aborted after 4..7 steps, the request's in-flight slot lands at every offset in its page once.
    core = make_core(tiny_llama, decode_buckets=(1, 2), overlap_schedule=True)
    core.add_request("r", PROMPTS[0], GREEDY)
    for _ in range(abort_after):
        core.step()
    assert core.overlap.inflight is not None
    core.abort("r")
    while core.has_work():
        core.step()
    stack = list(core.cache._roots.values())
    while stack:
        node = stack.pop()
        assert PENDING not in node.key
        stack.extend(node.children.values())
    assert_no_leaks(core)


def test_overlapped_sampled_steps_give_the_same_results(tiny_llama):
    # Seeded sampling (temperature, top-k, top-p, min-p), greedy with a logit bias, and n > 1 overlap
    # like greedy does (the draw stays on the device and feeds the next step); a request with a
    # penalty (which needs the token history) joins later and turns overlap off while it runs.
    # Noise is keyed by (seed, step, token), so every output equals the plain engine's.
    requests = {
        "t": (PROMPTS[0], SamplingParams(temperature=0.8, seed=5, max_new_tokens=20, ignore_eos=True)),
        "k": (PROMPTS[1], SamplingParams(temperature=1.2, top_k=20, top_p=0.9, seed=6, max_new_tokens=9)),
        "m": (PROMPTS[2], SamplingParams(temperature=1.0, min_p=0.05, seed=7, n=2, max_new_tokens=10,
                                          ignore_eos=True)),
        "b": (PROMPTS[3], SamplingParams(temperature=0, logit_bias={5: 4.0, 17: 3.0}, max_new_tokens=8,
                                          ignore_eos=True)),
    }
    late = ("p", PROMPTS[4], SamplingParams(temperature=0.7, seed=8, repetition_penalty=1.3, max_new_tokens=4,
                                            ignore_eos=True))
    results = []
    for core in (make_core(tiny_llama), make_core(tiny_llama, decode_buckets=(1, 2, 4, 8), overlap_schedule=True)):
        outputs: dict[tuple[str, int], list[int]] = {}
        for rid, (prompt, params) in requests.items():
            core.add_request(rid, prompt, params)
        steps = 0
        while core.has_work():
            for event in core.step():
                outputs.setdefault((event.rid, event.index), []).extend(event.token_ids)
            steps += 1
            if steps == 6:
                core.add_request(late[0], late[1], late[2])
        results.append(outputs)
        assert_no_leaks(core)
    assert core.overlapped_steps > 5
    assert results[1] == results[0]
    assert len(results[0]) == 6
