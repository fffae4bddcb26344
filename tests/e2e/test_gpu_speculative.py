"""Speculative decoding on the GPU: verify steps replayed in the CUDA verify graphs (Triton kernels,
the tree attention mask as a step input) give the tokens of plain greedy decoding on the same GPU
and weights: n-gram chains, EAGLE chains, EAGLE-2 trees and EAGLE-3 trees, on a random tiny Llama
with random heads in their published layouts. In f32, where greedy tokens must agree exactly (the
verify step's extend attention and the plain decode attention sum in other orders; at f32 a flip
needs a near tie, which random weights do not put in 24 tokens).

On the CPU the same engine paths run eagerly (tests/runtime/spec/); only here do graphs capture them."""

from __future__ import annotations

import pytest
import torch

from kiln.artifact_cache import ensure_artifact, ensure_model_artifacts
from kiln.compiler.options import CompileOptions
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.engine_options import EngineOptions
from kiln.runtime.sampling import SamplingParams
from tests.support.eagle_heads import write_eagle_head
from tests.support.hf_models import make_hf_model

pytestmark = pytest.mark.gpu

OPTIONS = CompileOptions(dtype="f32", backend="triton", page_size=16, max_batch_tokens=256, max_batch_size=8, max_seq_len=128)
ENGINE = dict(device="cuda", kv_cache_tokens=4096, decode_buckets=(1, 2, 4, 8), prefill_graphs=True)
# Looping prompts, so the n-gram drafts hit; two lengths of batch (1 and 4).
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 3], [11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11], [40, 41, 40]]
NEW_TOKENS = 24
SPECULATION = {
    "ngram": ("ngram", dict(speculative_num_draft_tokens=4)),
    "eagle-chain": ("eagle", dict(speculative_num_steps=3)),
    "eagle-tree": ("eagle", dict(speculative_eagle_topk=3, speculative_num_steps=3, speculative_num_draft_tokens=8)),
    "eagle3-tree": ("eagle3", dict(speculative_eagle_topk=3, speculative_num_steps=3, speculative_num_draft_tokens=8)),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[str, dict]]:
    """{name: (artifact, engine keywords)}: the plain target under "plain", and each speculation's as
    ``kiln serve``/``Engine`` compile it (logits rows for a full batch's verify, the EAGLE targets
    returning the head's features, the heads compiled beside them)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    root = tmp_path_factory.mktemp("gpu_spec")
    # Four layers: EAGLE-3's default feature layers (2, L // 2, L - 3) exist.
    target = make_hf_model("llama3", root / "target", num_hidden_layers=4)
    heads = {version: write_eagle_head(root / version, version) for version in ("eagle", "eagle3")}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KILN_HOME", str(root / "home"))
        built = {"plain": (str(ensure_artifact(target, OPTIONS)), {})}
        for name, (algorithm, shape) in SPECULATION.items():
            keywords = dict(speculative_algorithm=algorithm, **shape)
            if algorithm in heads:
                keywords["speculative_draft_model_path"] = str(heads[algorithm])
            artifact, draft = ensure_model_artifacts(target, OPTIONS, keywords)
            built[name] = (str(artifact), {**keywords, "speculative_draft_model_path": draft} if draft else keywords)
    return built


def generate(core: EngineCore, prompts: list[list[int]]) -> list[list[int]]:
    out = {str(i): [] for i in range(len(prompts))}
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(str(i), prompt, params)
    while core.has_work():
        for event in core.step():
            out[event.rid] += event.token_ids
    return list(out.values())


@pytest.mark.parametrize("name", sorted(SPECULATION))
@pytest.mark.parametrize("batch", [1, 4])
def test_speculative_verify_graphs_give_plain_greedy_tokens(models, name, batch, monkeypatch):
    prompts = PROMPTS[:batch]
    plain = generate(EngineCore(models["plain"][0], EngineOptions(**ENGINE)), prompts)
    artifact, keywords = models[name]
    core = EngineCore(artifact, EngineOptions(**ENGINE, **keywords))
    graphs = core.runner.verify_graphs
    assert graphs is not None
    replays = []
    real_run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda lists, tokens_from=None: replays.append(len(lists.q_len))
                        or real_run(lists, tokens_from))
    assert generate(core, prompts) == plain
    stats = core.stats()
    assert batch in replays, "no verify step of the whole batch ran as a graph"
    assert stats["spec_drafted_tokens"] > 0 and stats["kv_pages_held"] == 0
