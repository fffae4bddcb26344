"""Multi-LoRA in the engine core on a tiny random Llama: random PEFT adapters (non-zero B) against HF
with each adapter merged, a batch mixing the base model and three adapters, more adapters than
slots, the prefix cache namespaced by adapter, and unloading an adapter in use.

Tolerance: kiln and HF both run in f32 here; merging folds B @ A into W (one rounding of W, ~1e-7
relative) where kiln adds the update after the GEMM, so logprobs agree to ~1e-5; 1e-3 absolute
leaves room for summation order and still catches a wrong scaling (which moves them by >1e-2)."""

from __future__ import annotations

import pytest

from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.engine_options import EngineOptions
from kiln.runtime.lora.registry import UnknownAdapter
from kiln.runtime.sampling import SamplingParams
from tests.support.hf_models import hf_greedy, make_hf_model
from tests.support.lora import load_merged, make_peft_adapter

PROMPTS = [[1, 5, 9, 33, 2, 7, 100], list(range(200, 223)), [42, 7], [7] * 13]
GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True, logprobs=True)
ADAPTERS = (None, "a0", "a1", "a2")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    source = make_hf_model("llama3", tmp / "src")
    adapters = {"a0": make_peft_adapter(source, tmp / "a0", rank=4, seed=1),
                "a1": make_peft_adapter(source, tmp / "a1", rank=8, alpha=4.0, seed=2, use_rslora=True),
                "a2": make_peft_adapter(source, tmp / "a2", rank=2, seed=3, targets=("q_proj", "v_proj", "down_proj"))}
    artifacts = {slots: compile_model(source, tmp / f"m{slots}.kiln", CompileOptions(
        dtype="fp32", page_size=4, max_batch_tokens=64, max_batch_size=8, max_seq_len=64, max_loras=slots,
        max_lora_rank=8)) for slots in (2, 4)}
    return source, adapters, artifacts


@pytest.fixture(scope="module")
def reference(model):
    """HF's greedy tokens and their logprobs for (adapter, prompt), the adapter merged."""
    import torch

    source, adapters, _ = model
    results = {}
    for name in ADAPTERS:
        hf = load_merged(source, adapters[name] if name else None)
        for prompt in PROMPTS:
            tokens = hf_greedy(hf, prompt, GREEDY.max_new_tokens)
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
            logprobs = logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
            results[name, tuple(prompt)] = (tokens, logprobs)
    return results


def make_core(model, slots: int = 4, **options) -> EngineCore:
    source, adapters, artifacts = model
    core = EngineCore(str(artifacts[slots]), EngineOptions(device="cpu", kv_cache_tokens=1024, **options))
    for name, path in adapters.items():
        core.load_lora(name, str(path))
    return core


def run(core: EngineCore, requests: dict[str, tuple[list[int], str | None]], later: dict | None = None,
        after_steps: int = 2) -> dict[str, tuple[list[int], list[float], int]]:
    """Runs ``requests`` (rid -> (prompt, adapter)); ``later`` ones arrive after ``after_steps``
    steps, so their prefill shares steps with the others' decodes. rid -> (tokens, logprobs, cached)."""
    out = {rid: ([], [], 0) for rid in {**requests, **(later or {})}}
    for rid, (prompt, lora) in requests.items():
        core.add_request(rid, prompt, GREEDY, lora=lora)
    steps = 0
    while core.has_work() or later:
        if later and steps == after_steps:
            for rid, (prompt, lora) in later.items():
                core.add_request(rid, prompt, GREEDY, lora=lora)
            later = None
        for event in core.step():
            tokens, logprobs, cached = out[event.rid]
            out[event.rid] = (tokens + list(event.token_ids), logprobs + [lp.logprob for lp in event.logprobs],
                              max(cached, event.cached_tokens))
        steps += 1
    return out


def _check(result, expected):
    tokens, logprobs, _ = result
    assert tokens == expected[0]
    assert logprobs == pytest.approx(expected[1], abs=1e-3)


@pytest.mark.parametrize("name", ADAPTERS)
def test_each_adapter_alone_matches_hf_with_it_merged(model, reference, name):
    core = make_core(model)
    out = run(core, {f"r{i}": (p, name) for i, p in enumerate(PROMPTS)})
    for i, prompt in enumerate(PROMPTS):
        _check(out[f"r{i}"], reference[name, tuple(prompt)])
    if name is not None:  # the adapters do change the model's tokens
        assert any(reference[name, tuple(p)][0] != reference[None, tuple(p)][0] for p in PROMPTS)


@pytest.mark.parametrize("slots,prefill_graphs", [(4, False), (4, True), (2, False)])
def test_a_batch_mixing_base_and_three_adapters_gives_each_its_own_tokens(model, reference, slots, prefill_graphs):
    """Prefill and decode of different adapters in the same steps; with 2 slots for 3 adapters,
    requests wait for a slot and adapters move between host and device (and still match)."""
    core = make_core(model, slots, prefill_graphs=prefill_graphs)
    first = {f"x{i}": (PROMPTS[i], name) for i, name in enumerate(ADAPTERS)}
    later = {f"y{i}": (PROMPTS[(i + 1) % 4], name) for i, name in enumerate(reversed(ADAPTERS))}
    out = run(core, first, later)
    for rid, (prompt, name) in {**first, **later}.items():
        _check(out[rid], reference[name, tuple(prompt)])
    if slots == 2:
        assert core.lora.slot_loads >= 3  # three adapters through two slots: one was evicted to host memory


def test_the_prefix_cache_never_crosses_adapters(model, reference):
    core = make_core(model)
    prompt = PROMPTS[1]  # 23 tokens: 5 full pages enter the cache
    assert run(core, {"a": (prompt, "a0")})["a"][2] == 0
    assert run(core, {"b": (prompt, "a1")})["b"][2] == 0      # another adapter: nothing reused
    assert run(core, {"c": (prompt, None)})["c"][2] == 0      # nor for the base model
    again = run(core, {"d": (prompt, "a0")})["d"]              # the same adapter reuses its own
    assert again[2] > 0
    _check(again, reference["a0", tuple(prompt)])


def test_unloading_an_adapter_lets_its_requests_finish_and_refuses_new_ones(model, reference, tmp_path):
    core = make_core(model)
    core.add_request("r", PROMPTS[0], GREEDY, lora="a1")
    core.add_request("q", PROMPTS[2], GREEDY, lora="a1")  # queued behind, not yet running
    events = core.step()
    core.unload_lora("a1")
    assert "a1" not in core.lora_names()
    tokens = {"r": [], "q": []}
    for event in events:
        tokens[event.rid] += event.token_ids
    while core.has_work():
        for event in core.step():
            tokens[event.rid] += event.token_ids
    assert tokens["r"] == reference["a1", tuple(PROMPTS[0])][0]
    assert tokens["q"] == reference["a1", tuple(PROMPTS[2])][0]
    with pytest.raises(UnknownAdapter, match="'a1' does not exist"):
        core.add_request("s", PROMPTS[0], GREEDY, lora="a1")
    with pytest.raises(UnknownAdapter):
        core.unload_lora("a1")


def test_bad_loads_are_refused_by_name(model):
    core = make_core(model)
    with pytest.raises(ValueError, match="'a0' is already loaded"):
        core.load_lora("a0", str(model[1]["a0"]))
    with pytest.raises(ValueError, match="rank 16 is above the maximum LoRA rank 8"):
        core.load_lora("big", str(make_peft_adapter(model[0], model[1]["a0"].parent / "big", rank=16)))
    assert sorted(core.lora_names()) == ["a0", "a1", "a2"]


def test_an_artifact_without_lora_slots_refuses_adapters_naming_the_option(model, tmp_path):
    artifact = compile_model(model[0], tmp_path / "plain.kiln", CompileOptions(
        dtype="fp32", page_size=4, max_batch_tokens=64, max_batch_size=8, max_seq_len=64))
    core = EngineCore(str(artifact), EngineOptions(device="cpu", kv_cache_tokens=1024))
    with pytest.raises(ValueError, match="no LoRA slots; compile it with max_loras > 0"):
        core.load_lora("a0", str(model[1]["a0"]))
    with pytest.raises(ValueError, match="no LoRA slots"):
        core.add_request("r", PROMPTS[0], GREEDY, lora="a0")
