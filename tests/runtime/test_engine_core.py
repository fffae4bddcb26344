"""The engine core on a tiny random Llama-3 model: continuous batching with chunked prefill, the
radix prefix cache, eviction, retraction, abort, n > 1 and seeded sampling, with every result checked
against HF transformers or against a run without the feature, and the pool checked for leaks."""

from __future__ import annotations

import pytest

from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.engine_options import EngineOptions
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.scheduler.request import PENDING
from tests.support.hf_models import hf_greedy as greedy_continuation
from tests.support.hf_models import load_hf, make_hf_model

PAGE = 4
PROMPTS = [[1, 5, 9, 33, 2, 7, 100], [3, 4], list(range(200, 221)), [42], [1, 5, 9, 33, 2, 7, 100, 8, 9, 10, 11],
           [7] * 13, [100, 90, 80, 70, 60]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("core")
    source = make_hf_model("llama3", tmp / "src")
    artifact = compile_model(source, tmp / "m.kiln", CompileOptions(
        dtype="fp32", page_size=PAGE, max_batch_tokens=64, max_batch_size=16, max_seq_len=64))
    return source, artifact


@pytest.fixture(scope="module")
def hf_greedy(model):
    hf = load_hf(model[0])
    cache = {}

    def run(prompt: list[int], n: int = GREEDY.max_new_tokens) -> list[int]:
        key = (tuple(prompt), n)
        if key not in cache:
            cache[key] = greedy_continuation(hf, prompt, n)
        return cache[key]

    return run


def make_core(model, **options) -> EngineCore:
    options.setdefault("kv_cache_tokens", 1024)
    return EngineCore(str(model[1]), EngineOptions(device="cpu", **options))


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


def test_batched_chunked_prefill_matches_hf(model, hf_greedy):
    core = make_core(model, max_batch_tokens=8)
    outputs = run_all(core, {f"r{i}": (p, GREEDY) for i, p in enumerate(PROMPTS)})
    for i, prompt in enumerate(PROMPTS):
        assert outputs[f"r{i}"][0] == hf_greedy(prompt), f"prompt {i}"
    assert_no_leaks(core)


def test_shared_prefix_is_reused_and_output_unchanged(model, hf_greedy):
    core = make_core(model)
    base = list(range(10, 30))
    run_all(core, {"first": (base + [1, 2], GREEDY)})
    second = base + [7, 8, 9]
    outputs = run_all(core, {"second": (second, GREEDY)})
    shared = len(base) // PAGE * PAGE
    assert core.last_cached["second"] == shared
    assert outputs["second"][0] == hf_greedy(second)
    uncached = run_all(make_core(model, enable_prefix_cache=False), {"second": (second, GREEDY)})
    assert uncached["second"] == outputs["second"]
    assert_no_leaks(core)


def test_eviction_under_a_small_pool_keeps_results(model, hf_greedy):
    core = make_core(model, kv_cache_tokens=96, max_running=2)
    prompts = [[i, i + 1, i + 2, i + 3, i + 4, i + 5, i + 6] for i in range(0, 120, 12)]
    outputs = run_all(core, {f"r{i}": (p, GREEDY) for i, p in enumerate(prompts)})
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"][0] == hf_greedy(prompt)
    assert core.cache.evicted_tokens > 0
    assert_no_leaks(core)


def test_retraction_finishes_everything_with_the_same_result(model):
    params = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    requests = {f"r{i}": (p, params) for i, p in enumerate(PROMPTS)}
    reference = run_all(make_core(model, kv_cache_tokens=4096), requests)
    tight = make_core(model, kv_cache_tokens=64)
    outputs = run_all(tight, requests)
    assert tight.scheduler.num_retractions > 0
    assert outputs == reference
    assert_no_leaks(tight)


def test_abort_in_every_state_frees_everything(model):
    core = make_core(model, max_batch_tokens=8, max_running=2)
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


def test_n_samples_share_the_prompt_and_are_reproducible(model):
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=3, seed=1234, ignore_eos=True)
    prompt = list(range(50, 71))
    first = run_all(make_core(model), {"a": (prompt, params)})["a"]
    core = make_core(model)
    noise = SamplingParams(temperature=1.0, seed=5, max_new_tokens=8)
    again = run_all(core, {"b": (prompt, params), "noise": ([9, 9, 9], noise)})
    assert again["b"] == first
    assert len({tuple(s) for s in first}) > 1, "samples with different seeds should differ"
    # The followers computed only what the leader's cached pages did not cover.
    queried = core.cache.hit_tokens
    assert queried >= 2 * (len(prompt) // PAGE * PAGE)
    assert_no_leaks(core)


def test_seeded_sampling_ignores_batch_composition(model):
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_new_tokens=12, seed=77, ignore_eos=True)
    alone = run_all(make_core(model), {"x": (PROMPTS[0], params)})["x"]
    crowd = {f"o{i}": (p, SamplingParams(temperature=1.0, seed=i, max_new_tokens=9)) for i, p in enumerate(PROMPTS[1:])}
    together = run_all(make_core(model, max_batch_tokens=8), {**crowd, "x": (PROMPTS[0], params)})["x"]
    assert together == alone


@pytest.mark.parametrize("params, message", [
    (SamplingParams(temperature=-1), "temperature"),
    (SamplingParams(top_p=0), "top_p"),
    (SamplingParams(top_k=-2), "top_k"),
    (SamplingParams(max_new_tokens=0), "max_new_tokens"),
    (SamplingParams(max_new_tokens=60), "exceeds the context length"),
])
def test_invalid_requests_are_refused_and_others_continue(model, hf_greedy, params, message):
    core = make_core(model)
    core.add_request("good", PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match=message):
        core.add_request("bad", [1, 2, 3, 4, 5, 6, 7], params)
    outputs = {"good": [[]]}
    while core.has_work():
        for event in core.step():
            outputs[event.rid][event.index].extend(event.token_ids)
    assert outputs["good"][0] == hf_greedy(PROMPTS[0])


def test_requests_arriving_together_share_their_common_prefix(model, hf_greedy):
    core = make_core(model)
    shared = list(range(100, 140))
    prompts = {f"r{i}": (shared + [i + 1, i + 2], GREEDY) for i in range(4)}
    outputs = run_all(core, prompts)
    cached = sorted(core.last_cached.values())
    assert cached[0] == 0 and cached[1:] == [len(shared)] * 3
    for rid, (prompt, _) in prompts.items():
        assert outputs[rid][0] == hf_greedy(prompt)
    assert_no_leaks(core)


@pytest.mark.parametrize("graphs", [dict(decode_buckets=(1, 2, 4, 8)),
                                    dict(decode_buckets=(1, 2, 4), prefill_graphs=True)], ids=["decode", "prefill"])
def test_padded_buckets_give_the_same_tokens(model, hf_greedy, graphs):
    # On a CPU the bucketed graph paths run eagerly over the same static, padded buffers the GPU
    # captures; results must not depend on the padding. With prefill graphs that covers chunked
    # prefills, prefix-cache hits (contexts longer than the new tokens) and steps mixing prefill
    # chunks with decode rows; both runs include a seeded sampled request.
    core = make_core(model, **graphs)
    sampled = SamplingParams(temperature=0.9, seed=11, max_new_tokens=10, ignore_eos=True)
    requests = {f"r{i}": (p, GREEDY) for i, p in enumerate(PROMPTS)} | {"s": (PROMPTS[2], sampled)}
    outputs = run_all(core, requests)
    for i, prompt in enumerate(PROMPTS):
        assert outputs[f"r{i}"][0] == hf_greedy(prompt)
    assert outputs["s"] == run_all(make_core(model), {"s": (PROMPTS[2], sampled)})["s"]
    assert (core.runner.prefill_graphs is not None) == bool(graphs.get("prefill_graphs"))
    assert_no_leaks(core)


def test_overlapped_decode_steps_give_the_same_results(model, hf_greedy):
    # Each decode step is launched before the previous one's tokens are read; requests arrive,
    # finish (by length and by a stop token) and are aborted in the middle of such chains.
    plain = make_core(model)
    overlapped = make_core(model, decode_buckets=(1, 2, 4, 8), overlap_schedule=True)
    stop_at = hf_greedy(PROMPTS[1])[4]
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
    expected_b = hf_greedy(PROMPTS[1])
    assert overlapped_out["b"] == expected_b[:expected_b.index(stop_at) + 1]
    assert overlapped_out["a"] == hf_greedy(PROMPTS[0])
    assert_no_leaks(overlapped)


def test_overlapped_step_takes_the_in_flight_tokens_in_the_schedulers_row_order(model, hf_greedy):
    # The scheduler usually keeps the in-flight step's row order; when it does not (reversed by hand
    # here), the follow-up step gathers each row's input id from the in-flight tokens.
    core = make_core(model, decode_buckets=(1, 2, 4, 8), overlap_schedule=True)
    prompts = {f"r{i}": prompt for i, prompt in enumerate(PROMPTS[:3])}
    for rid, prompt in prompts.items():
        core.add_request(rid, prompt, GREEDY)
    outputs = {rid: [] for rid in prompts}
    reversed_at = None
    while core.has_work():
        for event in core.step():
            outputs[event.rid].extend(event.token_ids)
        if reversed_at is None and core._inflight is not None and core.overlapped_steps >= 2:
            core.scheduler.running.reverse()
            reversed_at = core.overlapped_steps
    assert reversed_at is not None and core.overlapped_steps > reversed_at
    for rid, prompt in prompts.items():
        assert outputs[rid] == hf_greedy(prompt), rid
    assert_no_leaks(core)


@pytest.mark.parametrize("abort_after", [4, 5, 6, 7])
def test_abort_during_overlap_never_caches_a_pending_slot(model, abort_after):
    # Aborted after 4..7 steps, the request's in-flight slot lands at every offset in its page once.
    core = make_core(model, decode_buckets=(1, 2), overlap_schedule=True)
    core.add_request("r", PROMPTS[0], GREEDY)
    for _ in range(abort_after):
        core.step()
    assert core._inflight is not None
    core.abort("r")
    while core.has_work():
        core.step()
    stack = list(core.cache._roots.values())
    while stack:
        node = stack.pop()
        assert PENDING not in node.key
        stack.extend(node.children.values())
    assert_no_leaks(core)


def test_overlapped_sampled_steps_give_the_same_results(model):
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
    for core in (make_core(model), make_core(model, decode_buckets=(1, 2, 4, 8), overlap_schedule=True)):
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


def test_prompt_logprobs_match_hf_across_chunks_and_a_cached_prefix(model):
    import torch

    hf = load_hf(model[0])
    prompt = list(range(200, 230))  # 30 tokens: more than the 16 logits rows a step returns (N)
    core = make_core(model, max_batch_tokens=24)
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


def test_a_request_that_raises_fails_alone(model, hf_greedy):
    core = make_core(model, debug_fail_token_id=77)
    core.add_request("poisoned", [5, 77, 9], GREEDY)
    core.add_request("fine", PROMPTS[0], GREEDY)
    events = []
    while core.has_work():
        events += core.step()
    failed = [e for e in events if e.rid == "poisoned" and e.error]
    assert failed and failed[0].error.startswith("internal error: RuntimeError: debug_fail_token_id 77")
    assert [t for e in events if e.rid == "fine" for t in e.token_ids] == hf_greedy(PROMPTS[0])
    assert_no_leaks(core)
