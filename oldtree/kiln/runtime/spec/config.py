"""Speculative decoding's options, under SGLang's names, and the start-up check that refuses the
combinations that cannot work.

The values live in ``EngineOptions`` (``speculative_*`` fields, the same names as ``Engine``'s
keywords and the ``--speculative-*`` flags); ``SpecConfig.from_options`` checks them against the
artifact's bounds once, when the engine core starts, and is what the step loop reads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("kiln.spec")

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
    # EAGLE: draft-model steps, and the children each step expands per node (1: a chain; more: a
    # dynamic tree of num_draft_tokens nodes, spec/tree.py).
    num_steps: int = 0
    eagle_topk: int = 1

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
        steps, topk = 0, 1
        if algorithm in DRAFT_HEADS:
            steps, topk, num_draft = _eagle_shape(given)
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
            if bounds["N"] < bounds["B"] * (num_draft + 1):
                log.warning("the artifact returns %d rows of logits a step: a step verifies drafts for about %d of "
                            "its %d sequences (compile it with --max-logit-rows %d for all of them)", bounds["N"],
                            bounds["N"] // (num_draft + 1), bounds["B"], bounds["B"] * (num_draft + 1))
        return SpecConfig(algorithm, num_draft, low, high, given.get("speculative_draft_model_path"), steps, topk)


def verify_tokens(keywords: dict[str, Any]) -> int:
    """Tokens (and logits rows) one request brings to a verify step under the speculative ``keywords``
    (``EngineOptions`` names, unset ones absent or None), checked as ``SpecConfig`` checks them; 1 when
    no algorithm this engine runs is named (the engine refuses an unknown one when it starts)."""
    algorithm = keywords.get("speculative_algorithm")
    if algorithm not in KNOWN_ALGORITHMS:
        return 1
    given = {name: keywords[name] for name in _ALGORITHM_OPTIONS if keywords.get(name) is not None}
    return (_eagle_shape(given)[2] if algorithm in DRAFT_HEADS else _ngram_draft_length(given)) + 1


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


def _eagle_shape(given: dict[str, Any]) -> tuple[int, int, int]:
    """(draft steps, top-k, draft tokens per request) of an EAGLE head. As in SGLang,
    ``speculative_num_draft_tokens`` counts the verified tokens, the request's last one included. At
    top-k 1 the drafts are a chain of ``speculative_num_steps`` tokens (so ``num_steps + 1`` verified);
    above, each of ``num_steps`` draft steps expands the ``topk`` best nodes into ``topk`` children
    each and the ``num_draft_tokens - 1`` best nodes make the tree (EAGLE-2)."""
    if "speculative_draft_model_path" not in given:
        raise ValueError("speculative_draft_model_path: EAGLE needs its draft head's checkpoint directory")
    # Here, not at the top: the tree's bound comes from the attention kernels (torch, Triton), which the
    # HTTP process reads these options without.
    from .tree import MAX_TREE_TOKENS

    topk = given.get("speculative_eagle_topk", 1)
    steps = given.get("speculative_num_steps")
    tokens = given.get("speculative_num_draft_tokens")
    if topk < 1:
        raise ValueError(f"speculative_eagle_topk must be at least 1, got {topk}")
    if steps is None:
        steps = tokens - 1 if tokens is not None and topk == 1 else DEFAULT_NUM_DRAFT_TOKENS
    if steps < 1:
        raise ValueError(f"speculative_num_steps must be at least 1, got {steps}")
    if topk == 1:
        if tokens is not None and tokens != steps + 1:
            raise ValueError(f"speculative_num_draft_tokens {tokens}: with speculative_eagle_topk 1 the step verifies "
                             f"the last token and speculative_num_steps {steps} drafts, so it must be {steps + 1}")
        return steps, 1, steps
    candidates = topk + (steps - 1) * topk * topk
    if tokens is None:
        tokens = min(candidates, MAX_TREE_TOKENS - 1) + 1
    if not 2 <= tokens <= min(candidates + 1, MAX_TREE_TOKENS):
        raise ValueError(f"speculative_num_draft_tokens {tokens}: a tree of speculative_eagle_topk {topk} over "
                         f"speculative_num_steps {steps} verifies 2 to {min(candidates + 1, MAX_TREE_TOKENS)} tokens "
                         f"({candidates} candidates, and at most {MAX_TREE_TOKENS} tokens: the tree mask's width)")
    if topk * (steps - 1) > MAX_TREE_TOKENS:
        raise ValueError(f"speculative_eagle_topk {topk} x (speculative_num_steps {steps} - 1): the draft steps lay "
                         f"out {topk * (steps - 1)} nodes, more than the tree mask's {MAX_TREE_TOKENS}")
    return steps, topk, tokens - 1


# The options that only mean something with an algorithm (None when not given).
_ALGORITHM_OPTIONS = ("speculative_num_draft_tokens", "speculative_num_steps", "speculative_eagle_topk",
                      "speculative_draft_model_path")
