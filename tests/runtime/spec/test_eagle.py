"""EAGLE and EAGLE-3 speculation end to end on a random tiny Llama (f32, CPU) with SmolLM2's
tokenizer (so stop strings and JSON schemas apply), the heads random too, in their published
layouts: greedy outputs identical to non-speculative decoding at batch 1 and 8, with stop strings,
a JSON schema, n > 1 and a shared prefix; and the start-up refusals naming what cannot work."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest

from kiln.artifact_cache import ensure_artifact, ensure_speculative_artifacts
from kiln.compiler.options import CompileOptions
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.engine_options import EngineOptions
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.spec.tree import DraftTree
from tests.support.eagle_heads import write_eagle_head
from tests.support.hf_models import make_hf_model

OPTIONS = CompileOptions(dtype="f32", page_size=4, max_batch_tokens=128, max_batch_size=8, max_seq_len=96)
SHARED = "The list of the planets, in order from the sun, is as follows: "
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def models(smollm2_dir, tmp_path_factory):
    """(target source dir, {version: (target artifact, draft artifact)}, plain target artifact)."""
    root = tmp_path_factory.mktemp("eagle")
    # Four layers: EAGLE-3's default feature layers (2, L // 2, L - 3) exist.
    target = make_hf_model("smollm2", root / "target", vocab_size=49152, num_hidden_layers=4)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (smollm2_dir / name).is_file():
            shutil.copy(smollm2_dir / name, target / name)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KILN_HOME", str(root / "home"))
        built = {version: ensure_speculative_artifacts(target, write_eagle_head(root / version, version, vocab=49152),
                                                       version, OPTIONS) for version in ("eagle", "eagle3")}
        plain = ensure_artifact(target, OPTIONS)
    return target, built, plain


def run(artifact, requests: list[tuple[str, SamplingParams]], **spec) -> tuple[list, dict]:
    return drain(EngineCore(str(artifact), EngineOptions(device="cpu", kv_cache_tokens=4096, **spec)), requests)


def drain(core: EngineCore, requests: list[tuple[str, SamplingParams]]) -> tuple[list, dict]:
    """Each (request, sample)'s tokens and finish reason, and the core's stats, once all are done."""
    out: dict = {}
    for i, (prompt, params) in enumerate(requests):
        core.add_request(str(i), core.tokenizer.encode(prompt), params)
    while core.has_work():
        for event in core.step():
            out.setdefault((event.rid, event.index), []).extend(event.token_ids)
            if event.finish_reason:
                out[(event.rid, event.index)].append(event.finish_reason)
    return sorted(out.items()), core.stats()


def stop_string(artifact) -> str:
    """Text the random model writes for "1, 2, 3, 4," a few tokens in: a stop string that really stops it."""
    core = EngineCore(str(artifact), EngineOptions(device="cpu", kv_cache_tokens=4096))
    core.add_request("0", core.tokenizer.encode("1, 2, 3, 4,"), SamplingParams(temperature=0, max_new_tokens=8,
                                                                                ignore_eos=True))
    tokens = []
    while core.has_work():
        tokens += [t for event in core.step() for t in event.token_ids]
    return core.tokenizer.decode(tokens[3:6])


# A chain of three drafts, and an EAGLE-2 tree: top-3 over three draft steps, seven nodes verified.
SHAPES = {"chain": dict(speculative_num_steps=3),
          "tree": dict(speculative_eagle_topk=3, speculative_num_steps=3, speculative_num_draft_tokens=8)}


def speculative(models, version, requests, shape="chain"):
    _, built, _ = models
    target, draft = built[version]
    return run(target, requests, speculative_algorithm=version, speculative_draft_model_path=str(draft),
               **SHAPES[shape])


def batch_of_eight(stop: str) -> list[tuple[str, SamplingParams]]:
    greedy = dict(temperature=0, ignore_eos=True)
    texts = ["Hello there", "1, 2, 3, 4,", "def f(x):", SHARED + "Mercury", SHARED + "Venus", "a", "The cat sat",
             "Once upon a time"]
    params = [SamplingParams(max_new_tokens=12 + i, **greedy) for i in range(8)]
    params[1] = SamplingParams(max_new_tokens=24, stop=[stop], **greedy)
    params[2] = SamplingParams(max_new_tokens=30, json_schema=json.dumps(SCHEMA), temperature=0)
    params[5] = SamplingParams(max_new_tokens=10, n=3, **greedy)
    return list(zip(texts, params))


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("version", ["eagle", "eagle3"])
def test_greedy_is_identical_to_non_speculative(models, version, shape):
    requests = batch_of_eight(stop_string(models[2]))
    plain, _ = run(models[2], requests)
    assert plain[1][1][-1] == "stop"  # the stop string ends it
    spec, stats = speculative(models, version, requests, shape)
    assert spec == plain
    assert stats["spec_drafted_tokens"] > 0
    single_plain, _ = run(models[2], requests[1:2])
    assert speculative(models, version, requests[1:2], shape)[0] == single_plain
    assert stats["kv_pages_held"] == 0


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("version", ["eagle", "eagle3"])
def test_draft_steps_replay_graphs_of_the_decode_buckets(models, version, shape, monkeypatch):
    """With decode buckets (CUDA graphs on a GPU, the same padded layout run eagerly here), the draft
    steps after the catch-up go through the draft head's graphs, hidden states as extra inputs: the
    outputs stay those of plain decoding, and the drafts those of eager draft steps (as many accepted)."""
    # Not the JSON-schema request: its grammar compiles on another thread, so the steps it joins vary
    # from run to run, and with them the drafts (not the outputs).
    requests = [r for i, r in enumerate(batch_of_eight(stop_string(models[2]))) if i in (0, 1, 3, 4)]
    plain, _ = run(models[2], requests)
    _, built, _ = models
    target, draft = built[version]

    def core() -> EngineCore:
        return EngineCore(str(target), EngineOptions(
            device="cpu", kv_cache_tokens=4096, decode_buckets=(1, 2, 4, 8), speculative_algorithm=version,
            speculative_draft_model_path=str(draft), **SHAPES[shape]))

    with_graphs, eager = core(), core()
    graphs = with_graphs.speculator.eagle.graphs
    assert graphs is not None and graphs.k == (3 if shape == "tree" else 1)
    replays = []
    real_run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda lists, tokens_from=None, extra_feeds=None:
                        replays.append(len(lists.q_len)) or real_run(lists, tokens_from, extra_feeds))
    monkeypatch.setattr(eager.speculator.eagle, "graphs", None)
    drafts = {id(with_graphs): [], id(eager): []}
    for engine in (with_graphs, eager):
        drafter = engine.speculator.eagle
        name = "propose_trees" if shape == "tree" else "propose"
        made = getattr(drafter, name)
        monkeypatch.setattr(drafter, name, lambda *args, made=made, out=drafts[id(engine)]:
                            out.append(made(*args)) or out[-1])
    spec, stats = drain(with_graphs, requests)
    assert spec == plain and drain(eager, requests) == (plain, stats)
    assert replays and stats["spec_drafted_tokens"] > 0 and stats["kv_pages_held"] == 0
    assert drafts[id(with_graphs)] == drafts[id(eager)]


def test_refusals_name_what_cannot_work(models):
    target, built, plain = models
    with pytest.raises(ValueError, match="speculative_draft_model_path: EAGLE needs its draft head"):
        run(plain, [], speculative_algorithm="eagle")
    with pytest.raises(ValueError, match=r"speculative_eagle_topk 4: the target artifact was compiled without tree"):
        run(plain, [], speculative_algorithm="eagle", speculative_draft_model_path=str(built["eagle"][1]),
            speculative_eagle_topk=4, speculative_num_steps=2, speculative_num_draft_tokens=6)
    with pytest.raises(ValueError, match="speculative_num_draft_tokens 3: .* so it must be 5"):
        run(plain, [], speculative_algorithm="eagle", speculative_draft_model_path="x", speculative_num_steps=4,
            speculative_num_draft_tokens=3)
    with pytest.raises(ValueError, match="the target artifact does not return aux_hidden_states"):
        run(plain, [], speculative_algorithm="eagle3", speculative_draft_model_path=str(built["eagle3"][1]))
    with pytest.raises(ValueError, match="is a compiled artifact; give the model's source"):
        ensure_speculative_artifacts(plain, target, "eagle", OPTIONS)
    head = built["eagle"][1]
    with pytest.raises(ValueError, match=r"'eagle' with pp=2 \(pipeline parallelism\) is not supported"):
        ensure_speculative_artifacts(target, head, "eagle", replace(OPTIONS, pp=2))
    with pytest.raises(ValueError, match=r"'eagle3' with max_loras=2 \(LoRA\) is not supported"):
        ensure_speculative_artifacts(target, head, "eagle3", replace(OPTIONS, max_loras=2))


def test_engine_keywords_compile_target_and_head(tmp_path, monkeypatch):
    """Engine(model source, speculative_algorithm=, speculative_draft_model_path=head checkpoint):
    both compiled, outputs as without speculation."""
    from kiln import Engine

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    target = make_hf_model("llama3", tmp_path / "target", num_hidden_layers=4)
    head = write_eagle_head(tmp_path / "head", "eagle3")
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [3, 4]]
    options = dict(dtype="f32", max_batch_tokens=64, max_batch_size=8, max_seq_len=64, device="cpu")
    with Engine(str(target), **options) as engine:
        plain = [o.token_ids for o in engine.generate(prompts, params)]
    with Engine(str(target), speculative_algorithm="eagle3", speculative_draft_model_path=str(head),
                speculative_num_steps=2, **options) as engine:
        assert [o.token_ids for o in engine.generate(prompts, params)] == plain
        assert engine.core.speculator.stats()["spec_drafted_tokens"] > 0


def test_an_accepted_path_off_the_first_nodes_is_moved_into_place(models):
    """Trees whose right answer is the root's second child (the first is wrong) with the rest of it
    below: the target accepts that path, whose KV sits past the wrong node's slot and must be moved
    into place for the next steps to read it; outputs stay those of plain greedy decoding. The trees
    come from a test-only oracle in the drafter's place (it knows the plain run's tokens)."""
    _, built, plain_artifact = models
    target, draft = built["eagle"]
    params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    requests = [("Hello there", params), ("The cat sat", params)]
    plain, _ = run(plain_artifact, requests)
    core = EngineCore(str(target), EngineOptions(device="cpu", kv_cache_tokens=4096, speculative_algorithm="eagle",
                                                 speculative_draft_model_path=str(draft), **SHAPES["tree"]))
    answers = [core.tokenizer.encode(prompt) + tokens for (prompt, _), (_, tokens) in zip(requests, plain)]

    def oracle_trees(requests, slots, topk, steps, num_nodes):
        trees = []
        for request in requests:
            ids = request.all_ids
            answer = next(a for a in answers if a[:len(ids)] == ids)
            right = answer[len(ids):len(ids) + 3]
            if not right:
                trees.append(DraftTree([], []))
                continue
            wrong = (right[0] + 1) % core.vocab_size
            trees.append(DraftTree([wrong, *right], [-1, -1, 1, 2][:1 + len(right)]))
        return trees

    core.speculator.eagle.propose_trees = oracle_trees
    out: dict = {}
    for i, (prompt, request_params) in enumerate(requests):
        core.add_request(str(i), core.tokenizer.encode(prompt), request_params)
    while core.has_work():
        for event in core.step():
            out.setdefault((event.rid, event.index), []).extend(event.token_ids)
    assert sorted(out.items()) == [(key, tokens[:-1]) for key, tokens in plain]  # (plain's end with its reason)
    stats = core.stats()
    assert stats["spec_mean_accept_length"] > 2.5 and stats["kv_pages_held"] == 0
