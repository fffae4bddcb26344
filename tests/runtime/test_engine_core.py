"""The engine core on a tiny random Llama-3 model (conftest's ``tiny_llama``): continuous batching with chunked prefill, the
radix prefix cache, eviction, retraction, abort, n > 1 and seeded sampling, with every result checked
against HF transformers or against a run without the feature, and the pool checked for leaks."""

from __future__ import annotations

import pytest

from kiln.runtime.engine_core import EngineCore
from kiln.runtime.engine_options import EngineOptions
from kiln.runtime.sampling import SamplingParams
from tests.runtime.conftest import TINY_LLAMA_PAGE as PAGE
from tests.support.hf_models import load_hf

PROMPTS = [[1, 5, 9, 33, 2, 7, 100], [3, 4], list(range(200, 221)), [42], [1, 5, 9, 33, 2, 7, 100, 8, 9, 10, 11],
           [7] * 13, [100, 90, 80, 70, 60]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)


def make_core(tiny_llama, **options) -> EngineCore:
    options.setdefault("kv_cache_tokens", 1024)
    return EngineCore(str(tiny_llama[1]), EngineOptions(device="cpu", **options))


def run_all(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[list[int]]]:
    for rid, (prompt, params) in requests.items():
        core.add_request(rid, prompt, params)
    outputs = {rid: [[] for _ in range(params.n)] for rid, (_, params) in requests.items()}
    cached = {}
    steps = 0
    while core.has_work():
        for event in core.step():
            outputs[event.rid][event.index].extend(event.token_ids)
            cached[event.rid] = event.cached_tokens
        steps += 1
        assert steps < 10_000
    core.last_cached = cached
    return outputs


def assert_no_leaks(core: EngineCore) -> None:
    assert not core.scheduler.running and not core.scheduler.waiting
    core.cache.check_invariants()
    assert core.cache.evictable_pages == core.cache.cached_pages, "a finished request left a lock behind"
    core.cache.reset()
    assert core.allocator.free_count == core.allocator.total


def test_batched_chunked_prefill_matches_hf(tiny_llama, tiny_llama_greedy):
    core = make_core(tiny_llama, max_batch_tokens=8)
    outputs = run_all(core, {f"r{i}": (p, GREEDY) for i, p in enumerate(PROMPTS)})
    for i, prompt in enumerate(PROMPTS):
        assert outputs[f"r{i}"][0] == tiny_llama_greedy(prompt), f"prompt {i}"
    assert_no_leaks(core)


def test_shared_prefix_is_reused_and_output_unchanged(tiny_llama, tiny_llama_greedy):
    core = make_core(tiny_llama)
    base = list(range(10, 30))
    run_all(core, {"first": (base + [1, 2], GREEDY)})
    second = base + [7, 8, 9]
    outputs = run_all(core, {"second": (second, GREEDY)})
    shared = len(base) // PAGE * PAGE
    assert core.last_cached["second"] == shared
    assert outputs["second"][0] == tiny_llama_greedy(second)
    uncached = run_all(make_core(tiny_llama, enable_prefix_cache=False), {"second": (second, GREEDY)})
    assert uncached["second"] == outputs["second"]
    assert_no_leaks(core)


def test_eviction_under_a_small_pool_keeps_results(tiny_llama, tiny_llama_greedy):
    core = make_core(tiny_llama, kv_cache_tokens=96, max_running=2)
    prompts = [[i, i + 1, i + 2, i + 3, i + 4, i + 5, i + 6] for i in range(0, 120, 12)]
    outputs = run_all(core, {f"r{i}": (p, GREEDY) for i, p in enumerate(prompts)})
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"][0] == tiny_llama_greedy(prompt)
    assert core.cache.evicted_tokens > 0
    assert_no_leaks(core)


def test_retraction_finishes_everything_with_the_same_result(tiny_llama):
    params = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    requests = {f"r{i}": (p, params) for i, p in enumerate(PROMPTS)}
    reference = run_all(make_core(tiny_llama, kv_cache_tokens=4096), requests)
    tight = make_core(tiny_llama, kv_cache_tokens=64)
    outputs = run_all(tight, requests)
    assert tight.scheduler.num_retractions > 0
    assert outputs == reference
    assert_no_leaks(tight)


def test_abort_in_every_state_frees_everything(tiny_llama):
    core = make_core(tiny_llama, max_batch_tokens=8, max_running=2)
    long = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        core.add_request(f"r{i}", p, long)
    core.step()
    core.step()
    states = {r.state.value for r in core.scheduler.running + list(core.scheduler.waiting)}
    assert {"waiting", "prefilling"} <= states or {"waiting", "decoding"} <= states
    for i in range(len(PROMPTS)):
        events = core.abort(f"r{i}")
        assert all(e.finish_reason == "abort" for e in events)
    assert_no_leaks(core)


def test_n_samples_share_the_prompt_and_are_reproducible(tiny_llama):
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=3, seed=1234, ignore_eos=True)
    prompt = list(range(50, 71))
    first = run_all(make_core(tiny_llama), {"a": (prompt, params)})["a"]
    core = make_core(tiny_llama)
    noise = SamplingParams(temperature=1.0, seed=5, max_new_tokens=8)
    again = run_all(core, {"b": (prompt, params), "noise": ([9, 9, 9], noise)})
    assert again["b"] == first
    assert len({tuple(s) for s in first}) > 1, "samples with different seeds should differ"
    # The followers computed only what the leader's cached pages did not cover.
    queried = core.cache.hit_tokens
    assert queried >= 2 * (len(prompt) // PAGE * PAGE)
    assert_no_leaks(core)


def test_seeded_sampling_ignores_batch_composition(tiny_llama):
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_new_tokens=12, seed=77, ignore_eos=True)
    alone = run_all(make_core(tiny_llama), {"x": (PROMPTS[0], params)})["x"]
    crowd = {f"o{i}": (p, SamplingParams(temperature=1.0, seed=i, max_new_tokens=9)) for i, p in enumerate(PROMPTS[1:])}
    together = run_all(make_core(tiny_llama, max_batch_tokens=8), {**crowd, "x": (PROMPTS[0], params)})["x"]
    assert together == alone


@pytest.mark.parametrize("params, message", [
    (SamplingParams(temperature=-1), "temperature"),
    (SamplingParams(top_p=0), "top_p"),
    (SamplingParams(top_k=-2), "top_k"),
    (SamplingParams(max_new_tokens=0), "max_new_tokens"),
    (SamplingParams(max_new_tokens=60), "exceeds the context length"),
])
def test_invalid_requests_are_refused_and_others_continue(tiny_llama, tiny_llama_greedy, params, message):
    core = make_core(tiny_llama)
    core.add_request("good", PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match=message):
        core.add_request("bad", [1, 2, 3, 4, 5, 6, 7], params)
    outputs = {"good": [[]]}
    while core.has_work():
        for event in core.step():
            outputs[event.rid][event.index].extend(event.token_ids)
    assert outputs["good"][0] == tiny_llama_greedy(PROMPTS[0])


def test_requests_arriving_together_share_their_common_prefix(tiny_llama, tiny_llama_greedy):
    core = make_core(tiny_llama)
    shared = list(range(100, 140))
    prompts = {f"r{i}": (shared + [i + 1, i + 2], GREEDY) for i in range(4)}
    outputs = run_all(core, prompts)
    cached = sorted(core.last_cached.values())
    assert cached[0] == 0 and cached[1:] == [len(shared)] * 3
    for rid, (prompt, _) in prompts.items():
        assert outputs[rid][0] == tiny_llama_greedy(prompt)
    assert_no_leaks(core)


@pytest.mark.parametrize("graphs", [dict(decode_buckets=(1, 2, 4, 8)),
                                    dict(decode_buckets=(1, 2, 4), prefill_graphs=True)], ids=["decode", "prefill"])
def test_padded_buckets_give_the_same_tokens(tiny_llama, tiny_llama_greedy, graphs):
    # On a CPU the bucketed graph paths run eagerly over the same static, padded buffers the GPU
    # captures; results must not depend on the padding. With prefill graphs that covers chunked
    # prefills, prefix-cache hits (contexts longer than the new tokens) and steps mixing prefill
    # chunks with decode rows; both runs include a seeded sampled request.
    core = make_core(tiny_llama, **graphs)
    sampled = SamplingParams(temperature=0.9, seed=11, max_new_tokens=10, ignore_eos=True)
    requests = {f"r{i}": (p, GREEDY) for i, p in enumerate(PROMPTS)} | {"s": (PROMPTS[2], sampled)}
    outputs = run_all(core, requests)
    for i, prompt in enumerate(PROMPTS):
        assert outputs[f"r{i}"][0] == tiny_llama_greedy(prompt)
    assert outputs["s"] == run_all(make_core(tiny_llama), {"s": (PROMPTS[2], sampled)})["s"]
    assert (core.runner.prefill_graphs is not None) == bool(graphs.get("prefill_graphs"))
    assert_no_leaks(core)


def test_prompt_logprobs_match_hf_across_chunks_and_a_cached_prefix(tiny_llama):
    import torch

    hf = load_hf(tiny_llama[0])
    prompt = list(range(200, 230))  # 30 tokens: more than the 16 logits rows a step returns (N)
    core = make_core(tiny_llama, max_batch_tokens=24)
    run_all(core, {"warm": (prompt[:20] + [1], GREEDY)})  # the prefix is now cached
    scored = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True, prompt_logprobs=True)
    core.add_request("scored", prompt, scored)
    core.add_request("other", PROMPTS[2], GREEDY)  # sharing the steps
    events = []
    while core.has_work():
        events += core.step()
    first = next(e for e in events if e.rid == "scored" and e.token_ids)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    expected = logits[:-1].log_softmax(-1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
    assert len(first.prompt_logprobs) == len(prompt) - 1
    assert max(abs(a - b) for a, b in zip(first.prompt_logprobs, expected)) < 1e-4  # f32, summation order
    assert all(not e.prompt_logprobs for e in events if e is not first)
    assert_no_leaks(core)


def test_prompt_logprobs_need_n_1():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(n=2, prompt_logprobs=True).validate()


def test_a_request_that_raises_fails_alone(tiny_llama, tiny_llama_greedy):
    core = make_core(tiny_llama, debug_fail_token_id=77)
    core.add_request("poisoned", [5, 77, 9], GREEDY)
    core.add_request("fine", PROMPTS[0], GREEDY)
    events = []
    while core.has_work():
        events += core.step()
    failed = [e for e in events if e.rid == "poisoned" and e.error]
    assert failed and failed[0].error.startswith("internal error: RuntimeError: debug_fail_token_id 77")
    assert [t for e in events if e.rid == "fine" for t in e.token_ids] == tiny_llama_greedy(PROMPTS[0])
    assert_no_leaks(core)
