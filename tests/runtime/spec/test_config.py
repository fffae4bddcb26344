"""The speculative options: SGLang's names on the CLI and ``EngineOptions``, and the combinations
refused at start-up with a message naming them."""

from __future__ import annotations

import argparse

import pytest

from kiln.cli_speculative import add_speculative_arguments, speculative_keywords
from kiln.runtime.engine_options import EngineOptions
from kiln.runtime.spec.config import SpecConfig

BOUNDS = {"T": 32, "B": 4, "N": 32}


def test_off_by_default():
    assert SpecConfig.from_options(EngineOptions(), BOUNDS) is None


def test_eagle_chains_count_steps_as_sglang():
    """speculative_num_draft_tokens counts the verified last token too (SGLang): steps + 1 for a chain."""
    for given in (dict(speculative_num_steps=3), dict(speculative_num_draft_tokens=4),
                  dict(speculative_num_steps=3, speculative_num_draft_tokens=4, speculative_eagle_topk=1)):
        config = SpecConfig.from_options(EngineOptions(speculative_algorithm="eagle3",
                                                       speculative_draft_model_path="/d", **given), BOUNDS)
        assert (config.num_draft_tokens, config.tokens_per_verify, config.draft_model_path) == (3, 4, "/d")


def test_ngram_defaults_and_given_values():
    config = SpecConfig.from_options(EngineOptions(speculative_algorithm="ngram"), BOUNDS)
    assert (config.algorithm, config.num_draft_tokens, config.ngram_min_window, config.ngram_max_window) == \
        ("ngram", 4, 1, 12)
    config = SpecConfig.from_options(EngineOptions(
        speculative_algorithm="ngram", speculative_num_draft_tokens=7, speculative_eagle_topk=1,
        speculative_ngram_min_match_window_size=2, speculative_ngram_max_match_window_size=3), BOUNDS)
    assert (config.num_draft_tokens, config.tokens_per_verify, config.ngram_min_window, config.ngram_max_window) == \
        (7, 8, 2, 3)


@pytest.mark.parametrize("options, named", [
    (dict(speculative_num_draft_tokens=4), "speculative_num_draft_tokens"),
    (dict(speculative_algorithm="medusa"), "'medusa' is not an algorithm; supported: ngram, eagle, eagle3"),
    (dict(speculative_algorithm="eagle3"), "speculative_draft_model_path: EAGLE needs its draft head"),
    (dict(speculative_algorithm="eagle", speculative_draft_model_path="/x", speculative_eagle_topk=2,
          speculative_num_steps=2, speculative_num_draft_tokens=8), "verifies 2 to 7 tokens"),
    (dict(speculative_algorithm="eagle", speculative_draft_model_path="/x", speculative_eagle_topk=8,
          speculative_num_steps=6, speculative_num_draft_tokens=16), "more than the tree mask's 32"),
    (dict(speculative_algorithm="ngram", speculative_draft_model_path="/x"), "speculative_draft_model_path"),
    (dict(speculative_algorithm="ngram", speculative_num_steps=3), "speculative_num_steps"),
    (dict(speculative_algorithm="ngram", speculative_eagle_topk=4), "speculative_eagle_topk"),
    (dict(speculative_algorithm="ngram", speculative_num_draft_tokens=0), "at least 1"),
    (dict(speculative_algorithm="ngram", speculative_ngram_min_match_window_size=5,
          speculative_ngram_max_match_window_size=2), "speculative_ngram_min_match_window_size"),
    (dict(speculative_algorithm="ngram", overlap_schedule=True), "overlap_schedule"),
    (dict(speculative_algorithm="ngram", speculative_num_draft_tokens=32), "at most 32"),
])
def test_refused_combinations_name_the_options(options, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        SpecConfig.from_options(EngineOptions(**options), BOUNDS)


def test_cli_flags_become_the_keywords():
    parser = argparse.ArgumentParser()
    add_speculative_arguments(parser)
    args = parser.parse_args(["--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "6",
                              "--speculative-ngram-max-match-window-size", "5"])
    keywords = speculative_keywords(args)
    assert keywords == {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 6,
                        "speculative_ngram_max_match_window_size": 5}
    assert SpecConfig.from_options(EngineOptions(**keywords), BOUNDS).num_draft_tokens == 6
    assert speculative_keywords(parser.parse_args([])) == {}


def test_an_artifact_with_too_few_logits_rows_for_a_full_batch_verify_is_named_at_start(caplog):
    with caplog.at_level("WARNING", logger="kiln.spec"):
        SpecConfig.from_options(EngineOptions(speculative_algorithm="ngram", speculative_num_draft_tokens=3),
                                {"T": 64, "B": 4, "N": 8})
    assert "verifies drafts for about 2 of its 4 sequences (compile it with --max-logit-rows 16" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="kiln.spec"):
        SpecConfig.from_options(EngineOptions(speculative_algorithm="ngram", speculative_num_draft_tokens=3),
                                {"T": 64, "B": 4, "N": 16})
    assert caplog.text == ""
