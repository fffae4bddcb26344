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
SUPPORTED_ALGORITHMS = ("ngram",)
DEFAULT_NUM_DRAFT_TOKENS = 4


@dataclass(frozen=True)
class SpecConfig:
    """Checked speculative settings: ``num_draft_tokens`` drafts at most per request per step (the
    verify step brings one more: the request's last token)."""

    algorithm: str
    num_draft_tokens: int
    ngram_min_window: int
    ngram_max_window: int

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
        if algorithm not in SUPPORTED_ALGORITHMS:
            raise ValueError(f"speculative_algorithm: {algorithm!r} draft heads are not supported by this engine "
                             f"yet; supported: {', '.join(SUPPORTED_ALGORITHMS)}")
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
        return SpecConfig(algorithm, num_draft, low, high)


# The options that only mean something with an algorithm (None when not given).
_ALGORITHM_OPTIONS = ("speculative_num_draft_tokens", "speculative_num_steps", "speculative_eagle_topk",
                      "speculative_draft_model_path")
