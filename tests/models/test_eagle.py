"""EAGLE and EAGLE-3 draft heads compiled from their published layouts: outputs against a plain torch
reference, and the refusals of heads that do not fit their target."""

import pytest
import torch

from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.compiler.sources.eagle import load_draft_source
from kiln.compiler.sources.hf import load_hf_dir
from kiln.runtime.artifact import load_artifact
from kiln.runtime.worker.model_runner import ModelRunner
from tests.support.eagle_heads import reference_draft, write_eagle_head
from tests.support.hf_models import make_hf_model
from tests.support.stepping import pages_for, step_lists

DRAFT_OPTIONS = CompileOptions(dtype="f32", page_size=4, max_batch_tokens=32, max_batch_size=8, max_logit_rows=32, max_seq_len=64,
                               step_outputs=("hidden_states", "draft_tokens"))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_hf_dir(make_hf_model("llama3", tmp_path_factory.mktemp("target")))


@pytest.mark.parametrize("version", ["eagle", "eagle3"])
def test_draft_matches_reference(tmp_path, target, version):
    """Two sequences (7 and 5 rows) in one step, every row's logits: f32 on both sides, 1e-4 covers
    summation order. draft_tokens is the argmax mapped to target ids (EAGLE-3: through d2t)."""
    draft = load_draft_source(write_eagle_head(tmp_path / "head", version), target, version)
    artifact = compile_model(draft.source, tmp_path / "draft.kiln", DRAFT_OPTIONS)
    runner = ModelRunner(load_artifact(artifact), "cpu", num_pages=16)
    lists = step_lists([7, 5], [0, 0], [], pages_for([7, 5]), every_token=(0, 1))
    width = 3 * 64 if version == "eagle3" else 64
    features = torch.randn(12, width)
    feeds = {"draft_hidden": torch.zeros(12, 64), "target_features": features} if version == "eagle3" \
        else {"draft_hidden": features}
    out = runner.forward_eager(lists, feeds).outputs
    weights = {name: draft.source.tensors.get(name) for name in draft.source.tensors.names()}
    for start, count in ((0, 7), (7, 5)):
        rows = slice(start, start + count)
        logits, hidden = reference_draft(version, weights, torch.tensor(lists.token_ids[rows]), features[rows],
                                         torch.tensor(lists.positions[rows]))
        torch.testing.assert_close(out["logits"][rows], logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out["hidden_states"][rows], hidden, atol=1e-4, rtol=1e-4)
        best = logits.argmax(-1)
        expected = best + weights["d2t"][best] if version == "eagle3" else best
        assert out["draft_tokens"][rows].tolist() == expected.tolist()
    assert draft.target_output == ("aux_hidden_states" if version == "eagle3" else "token_hidden_states")


def test_eagle3_continues_from_its_own_hidden_state(tmp_path, target):
    """A row given draft_hidden (target_features zero) is the row whose fc output that was."""
    draft = load_draft_source(write_eagle_head(tmp_path / "head", "eagle3"), target, "eagle3")
    runner = ModelRunner(load_artifact(compile_model(draft.source, tmp_path / "d.kiln", DRAFT_OPTIONS)), "cpu", 16)
    lists = step_lists([3], [0], [], pages_for([3]), every_token=(0,))
    features = torch.randn(3, 192)
    from_target = runner.forward_eager(lists, {"draft_hidden": torch.zeros(3, 64), "target_features": features})
    from_target = from_target.outputs["logits"].clone()
    fc = draft.source.tensors.get("fc.weight")
    own = runner.forward_eager(lists, {"draft_hidden": features @ fc.T, "target_features": torch.zeros(3, 192)})
    torch.testing.assert_close(own.outputs["logits"], from_target, atol=1e-5, rtol=1e-5)


def test_model_prefix_and_layer_ids_are_read(tmp_path, target):
    import json

    head = write_eagle_head(tmp_path / "head", "eagle3")
    config = json.loads((head / "config.json").read_text())
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 0, 1]}
    (head / "config.json").write_text(json.dumps(config))
    assert load_draft_source(head, target, "eagle3").aux_hidden_layers == (1, 1, 2)


def test_heads_that_do_not_fit_are_refused(tmp_path, target):
    with pytest.raises(ValueError, match="the draft's hidden size 32 does not fit the target's 64"):
        load_draft_source(write_eagle_head(tmp_path / "narrow", "eagle", hidden=32), target, "eagle")
    with pytest.raises(ValueError, match=r"fc.weight reads 192 features, speculative_algorithm 'eagle' needs 128; "
                                         r"is it an 'eagle3' head\?"):
        load_draft_source(write_eagle_head(tmp_path / "e3", "eagle3"), target, "eagle")
    small = load_hf_dir(make_hf_model("llama3", tmp_path / "small_vocab", vocab_size=300))
    with pytest.raises(ValueError, match=r"the draft's vocabulary \(320 tokens\) is not the target's \(300\)"):
        load_draft_source(tmp_path / "e3", small, "eagle3")
    with pytest.raises(ValueError, match="'ngram' has no draft head; draft heads: eagle, eagle3"):
        load_draft_source(tmp_path / "e3", target, "ngram")
