"""Rejection sampling keeps the target's distribution (n-gram drafts, an EAGLE head's chains and its
EAGLE-2 trees): on a random model with an 8-token vocabulary,
speculative samples of three tokens against the exact joint distribution the model gives (products
of HF's softmax(logits / T)), by a chi-square goodness-of-fit test at significance 0.001 (cells
expected to hold fewer than 5 draws pooled into one). The prompt holds every token, so the n-gram
drafter always drafts: the second token is a verified draft or the residual draw, the third the
extra token after an accepted draft (or a plain step). Seeds are fixed, so the test is deterministic.
Also the rule itself on fixed logits: acceptance with probability p(d), the residual without d, and
a tree node's several children tried in turn."""

from __future__ import annotations

import pytest
import torch

from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.engine_options import EngineOptions
from kiln.runtime.sampling import SamplerKernels, SamplingBatch, SamplingParams, SamplingRow
from kiln.runtime.spec.tree import DraftTree
from kiln.runtime.spec.verify import accept, row_choices
from kiln.artifact_cache import ensure_speculative_artifacts
from tests.support.eagle_heads import write_eagle_head
from tests.support.hf_models import load_hf, make_hf_model

VOCAB = 8
PROMPT = [0, 1, 2, 3, 4, 5, 6, 7, 3, 1]
TEMPERATURE = 1.3
SAMPLES_PER_REQUEST, REQUESTS = 50, 60
SIGNIFICANCE = 1e-3


def chi_square_p_value(observed: dict, expected_probs: dict, draws: int) -> tuple[float, int]:
    """(p-value, degrees of freedom) of the observed counts against the expected probabilities."""
    expected = {cell: p * draws for cell, p in expected_probs.items()}
    small = [cell for cell, e in expected.items() if e < 5]
    bins = [(observed.get(cell, 0), e) for cell, e in expected.items() if e >= 5]
    bins.append((sum(observed.get(cell, 0) for cell in small), sum(expected[cell] for cell in small)))
    statistic = sum((o - e) ** 2 / e for o, e in bins if e > 0)
    dof = len(bins) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64))), dof


def exact_joint(hf_dir, length: int) -> dict[tuple[int, ...], float]:
    model = load_hf(hf_dir)
    joint = {(): 1.0}
    with torch.no_grad():
        for _ in range(length):
            grown = {}
            for prefix, p in joint.items():
                logits = model(torch.tensor([PROMPT + list(prefix)])).logits[0, -1].double()
                probs = torch.softmax(logits / TEMPERATURE, dim=-1).tolist()
                grown.update({prefix + (t,): p * probs[t] for t in range(VOCAB)})
            joint = grown
    return joint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_vocab")
    hf_dir = make_hf_model("llama3", directory / "src", vocab_size=VOCAB)
    options = CompileOptions(dtype="fp32", page_size=4, max_batch_tokens=256, max_batch_size=64, max_seq_len=32)
    return hf_dir, compile_model(hf_dir, directory / "m.kiln", options)


@pytest.fixture(scope="module")
def tiny_eagle(tiny, tmp_path_factory):
    """The same target compiled to return its features, and a random EAGLE head of its vocabulary."""
    hf_dir, _ = tiny
    directory = tmp_path_factory.mktemp("tiny_eagle")
    options = CompileOptions(dtype="fp32", page_size=4, max_batch_tokens=256, max_batch_size=64, max_seq_len=32)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KILN_HOME", str(directory / "home"))
        target, draft = ensure_speculative_artifacts(hf_dir, write_eagle_head(directory / "head", "eagle", vocab=VOCAB),
                                                     "eagle", options)
    return hf_dir, target, draft


@pytest.mark.parametrize("algorithm", ["ngram", "eagle", "eagle_tree"])
def test_speculative_samples_follow_the_target_distribution(tiny, tiny_eagle, algorithm):
    """n-gram drafts, an EAGLE head's greedy chains (a deterministic proposal too: the same rule) and
    its top-k trees (each node's children tried in turn)."""
    if algorithm == "ngram":
        hf_dir, artifact = tiny
        spec = dict(speculative_algorithm="ngram", speculative_num_draft_tokens=3)
    else:
        hf_dir, artifact, draft = tiny_eagle
        spec = dict(speculative_algorithm="eagle", speculative_draft_model_path=str(draft), speculative_num_steps=3)
        if algorithm == "eagle_tree":
            spec.update(speculative_eagle_topk=3, speculative_num_steps=2, speculative_num_draft_tokens=6)
    core = EngineCore(str(artifact), EngineOptions(device="cpu", kv_cache_tokens=4096, **spec))
    for i in range(REQUESTS):
        core.add_request(str(i), PROMPT, SamplingParams(temperature=TEMPERATURE, max_new_tokens=3, ignore_eos=True,
                                                        n=SAMPLES_PER_REQUEST, seed=1000 + i))
    outputs: dict[tuple[str, int], list[int]] = {}
    while core.has_work():
        for event in core.step():
            outputs.setdefault((event.rid, event.index), []).extend(event.token_ids)
    draws = REQUESTS * SAMPLES_PER_REQUEST
    assert len(outputs) == draws and all(len(tokens) == 3 for tokens in outputs.values())
    stats = core.stats()
    # Drafts were verified, some accepted and some rejected.
    assert 0 < stats["spec_accepted_drafts"] < stats["spec_drafted_tokens"]
    observed: dict[tuple[int, ...], int] = {}
    for tokens in outputs.values():
        observed[tuple(tokens)] = observed.get(tuple(tokens), 0) + 1
    p_value, dof = chi_square_p_value(observed, exact_joint(hf_dir, 3), draws)
    assert p_value > SIGNIFICANCE, (p_value, dof)


def test_the_rule_on_fixed_logits():
    """Each seed's row 0 verifies draft 2 (p = 0.5), row 1 gives the extra token: over the seeds
    draft 2 is accepted half the time, the residual never gives 2, and the first token follows p."""
    probs = torch.tensor([0.1, 0.2, 0.5, 0.2])
    seeds = range(4000)
    params = SamplingParams(temperature=1.0)
    batch = SamplingBatch.pack([SamplingRow(params, seed, step) for seed in seeds for step in (0, 1)], 4)
    choices = row_choices(probs.log()[None].repeat(2 * len(seeds), 1), batch, None, [[2], []] * len(seeds),
                          SamplerKernels.for_device("cpu"))
    firsts = [0] * 4
    accepted = 0
    for i in range(len(seeds)):
        path, tokens = accept(choices, 2 * i, DraftTree.chain([2]))
        count = len(path)
        accepted += count
        firsts[tokens[0]] += 1
        assert count == 1 or (tokens[0] != 2 and len(tokens) == 1)
    p_value, _ = chi_square_p_value({(t,): c for t, c in enumerate(firsts)},
                                    {(t,): float(p) for t, p in enumerate(probs)}, len(seeds))
    assert p_value > SIGNIFICANCE and accepted == firsts[2]


def test_a_nodes_children_are_tried_in_turn():
    """The root's row verifies children 2 and 1 (and a repeat of 2, tried once): child 2 is accepted
    with p(2) = 0.5, child 1 with p(1) = 0.2, else the residual draws 0 or 3; the first token follows p."""
    probs = torch.tensor([0.1, 0.2, 0.5, 0.2])
    seeds = range(4000)
    tree = DraftTree([2, 1, 2], [-1, -1, -1])
    batch = SamplingBatch.pack([SamplingRow(SamplingParams(temperature=1.0), seed, step) for seed in seeds
                                for step in (0, 1, 1, 1)], 4)
    choices = row_choices(probs.log()[None].repeat(4 * len(seeds), 1), batch, None, [[2, 1], [], [], []] * len(seeds),
                          SamplerKernels.for_device("cpu"))
    firsts = [0] * 4
    for i in range(len(seeds)):
        path, tokens = accept(choices, 4 * i, tree)
        assert path in ([], [0], [1]) and (path == [] or tree.tokens[path[0]] == tokens[0])
        assert path or tokens[0] in (0, 3)
        firsts[tokens[0]] += 1
    p_value, _ = chi_square_p_value({(t,): c for t, c in enumerate(firsts)},
                                    {(t,): float(p) for t, p in enumerate(probs)}, len(seeds))
    assert p_value > SIGNIFICANCE


def test_greedy_rows_accept_the_argmax_prefix():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    batch = SamplingBatch.pack([SamplingRow(SamplingParams(temperature=0), 0, i) for i in range(3)], 3)
    choices = row_choices(logits, batch, None, [[1], [2], []], SamplerKernels.for_device("cpu"))
    # draft 1 matches, 2 does not: the argmax 0 instead
    assert accept(choices, 0, DraftTree.chain([1, 2])) == ([0], [1, 0])
    # both match: the last row's argmax is the extra token
    assert accept(choices, 0, DraftTree.chain([1, 0])) == ([0, 1], [1, 0, 2])


def test_greedy_rows_walk_a_tree():
    """The root's argmax 1 takes node 1 of its children (2, 1); node 1's row (2) has argmax 0, its
    child node 2; node 2's row (3) gives the extra token 1."""
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 9.0], [4.0, 0.0, 1.0], [0.0, 7.0, 1.0], [0.0, 0.0, 5.0]])
    batch = SamplingBatch.pack([SamplingRow(SamplingParams(temperature=0), 0, i) for i in range(5)], 3)
    tree = DraftTree([2, 1, 0, 2], [-1, -1, 1, 0])
    choices = row_choices(logits, batch, None, [[2, 1], [2], [0], [], []], SamplerKernels.for_device("cpu"))
    assert accept(choices, 0, tree) == ([1, 2], [1, 0, 1])
