"""Speculative decoding's options, under SGLang's names, and the start-up check that refuses the
combinations that cannot work.

The values live in ``EngineOptions`` (``speculative_*`` fields, the same names as ``Engine``'s
keywords and the ``--speculative-*`` flags); ``SpecConfig.from_options`` checks them against the
artifact's bounds once, when the engine core starts, and is what the step loop reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Algorithms named by the option; the ones this engine runs.
KNOWN_ALGORITHMS = ("ngram", "eagle", "eagle3")
SUPPORTED_ALGORITHMS = ("ngram", "eagle", "eagle3")
DRAFT_HEADS = ("eagle", "eagle3")
DEFAULT_NUM_DRAFT_TOKENS = 4


@dataclass(frozen=True)
class SpecConfig:
    """Checked speculative settings: ``num_draft_tokens`` drafts at most per request per step (the
    verify step brings one more: the request's last token)."""

    algorithm: str
    num_draft_tokens: int
    ngram_min_window: int
    ngram_max_window: int
    draft_model_path: str | None = None  # EAGLE: the compiled draft head's artifact

    @property
    def tokens_per_verify(self) -> int:
        return self.num_draft_tokens + 1

    @staticmethod
    def from_options(options: Any, bounds: dict[str, int] | None = None) -> "SpecConfig | None":
        """The config ``options`` (an ``EngineOptions``) ask for, None when speculation is off; raises
        ValueError naming the options when they cannot work together (or with the artifact's
        ``bounds``, the step sizes it was compiled for)."""
        algorithm = options.speculative_algorithm
        given = {name: getattr(options, name) for name in _ALGORITHM_OPTIONS if getattr(options, name) is not None}
        if algorithm is None:
            if given:
                raise ValueError(f"{', '.join(sorted(given))}: set only with speculative_algorithm "
                                 f"(one of {', '.join(SUPPORTED_ALGORITHMS)})")
            return None
        if algorithm not in KNOWN_ALGORITHMS:
            raise ValueError(f"speculative_algorithm: {algorithm!r} is not an algorithm; supported: "
                             f"{', '.join(SUPPORTED_ALGORITHMS)}")
        if algorithm in DRAFT_HEADS:
            num_draft = _eagle_chain_length(given)
        else:
            num_draft = _ngram_draft_length(given)
        low = options.speculative_ngram_min_match_window_size
        high = options.speculative_ngram_max_match_window_size
        if not 1 <= low <= high:
            raise ValueError("speculative_ngram_min_match_window_size and speculative_ngram_max_match_window_size "
                             f"need 1 <= min <= max, got {low} and {high}")
        if options.overlap_schedule:
            raise ValueError("overlap_schedule and speculative_algorithm: a verify step's next input depends on "
                             "what the host accepts, so it cannot be launched before the host reads it")
        if bounds is not None:
            # Every running request may verify in the same step: num_draft + 1 tokens and logits rows each.
            room = min(bounds["T"], bounds["N"])
            if num_draft + 1 > room:
                raise ValueError(f"speculative_num_draft_tokens {num_draft}: a verify step of one request brings "
                                 f"{num_draft + 1} tokens, and the artifact's steps hold at most {room}")
        return SpecConfig(algorithm, num_draft, low, high, given.get("speculative_draft_model_path"))


def _ngram_draft_length(given: dict[str, Any]) -> int:
    # n-gram drafts are a chain looked up in the request's own tokens: no model, no tree, no steps.
    for name, why in (("speculative_draft_model_path", "n-gram drafts need no draft model"),
                      ("speculative_num_steps", "n-gram drafts are one lookup, not draft-model steps")):
        if name in given:
            raise ValueError(f"{name} does not apply to speculative_algorithm 'ngram': {why}")
    if given.get("speculative_eagle_topk", 1) != 1:
        raise ValueError("speculative_eagle_topk: n-gram drafts are a chain (top-k 1), got "
                         f"{given['speculative_eagle_topk']}")
    num_draft = given.get("speculative_num_draft_tokens", DEFAULT_NUM_DRAFT_TOKENS)
    if num_draft < 1:
        raise ValueError(f"speculative_num_draft_tokens must be at least 1, got {num_draft}")
    return num_draft


def _eagle_chain_length(given: dict[str, Any]) -> int:
    """The drafts an EAGLE head proposes per step: ``speculative_num_steps`` draft-model steps of one
    token each (top-k 1: a chain). As in SGLang, ``speculative_num_draft_tokens`` counts the verified
    tokens, the request's last one included: ``num_steps + 1`` for a chain."""
    if "speculative_draft_model_path" not in given:
        raise ValueError("speculative_draft_model_path: EAGLE needs its draft head's checkpoint directory")
    topk = given.get("speculative_eagle_topk", 1)
    if topk != 1:
        raise ValueError(f"speculative_eagle_topk {topk}: draft trees (top-k > 1) are not supported by this engine "
                         "yet; supported: 1 (a chain of speculative_num_steps tokens)")
    steps = given.get("speculative_num_steps")
    tokens = given.get("speculative_num_draft_tokens")
    if steps is None:
        steps = tokens - 1 if tokens is not None else DEFAULT_NUM_DRAFT_TOKENS
    if steps < 1:
        raise ValueError(f"speculative_num_steps must be at least 1, got {steps}")
    if tokens is not None and tokens != steps + 1:
        raise ValueError(f"speculative_num_draft_tokens {tokens}: with speculative_eagle_topk 1 the step verifies "
                         f"the last token and speculative_num_steps {steps} drafts, so it must be {steps + 1}")
    return steps


# The options that only mean something with an algorithm (None when not given).
_ALGORITHM_OPTIONS = ("speculative_num_draft_tokens", "speculative_num_steps", "speculative_eagle_topk",
                      "speculative_draft_model_path")
