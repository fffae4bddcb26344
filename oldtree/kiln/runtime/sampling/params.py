"""``SamplingParams``: how one request wants its tokens chosen, and when its generation stops.

The fields follow the OpenAI API and vLLM where they overlap. ``validate`` checks ranges and types
and raises ``ValueError`` naming the offending parameter, so the server can return it as a 400.
Checks that need the model's context length (prompt + ``max_new_tokens``) are the engine's.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

# Temperatures below this are treated as 0 (greedy): dividing logits by them overflows or turns
# sampling into argmax anyway, with extra noise.
GREEDY_TEMPERATURE = 1e-5
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
# The output constraints a request may give (at most one), as the grammar compiler names their kinds.
CONSTRAINT_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k filtering
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF style, over prompt and output tokens
    frequency_penalty: float = 0.0  # OpenAI style, over output tokens
    presence_penalty: float = 0.0
    seed: int | None = None  # None: the engine draws one when the request is created
    stop: list[str] = field(default_factory=list)
    # Python ``re`` patterns searched in the output text as it grows (SGLang's extension); the
    # first match ends the sample, cut where the match begins, as a stop string cuts it.
    stop_regex: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False  # report the chosen token's logprob
    top_logprobs: int = 0  # and this many most likely alternatives
    prompt_logprobs: bool = False  # each prompt token's logprob given the tokens before it (n = 1 only)
    n: int = 1
    logit_bias: dict[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True
    # Constrained decoding: at most one of these; the grammar engine reads them.
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: dict[str, Any] | None = None  # xgrammar's structural tag (tool calls use one)

    def __post_init__(self) -> None:
        # The OpenAI API lets `stop` be one string and JSON object keys are strings: accept both
        # spellings here so every caller need not.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop_regex, str):
            self.stop_regex = [self.stop_regex]
        if isinstance(self.logit_bias, dict):
            self.logit_bias = {int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k: v
                               for k, v in self.logit_bias.items()}

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def argmax_of_logits(self) -> bool:
        """Greedy with nothing added to the logits (no logit_bias, no penalties): the next token is
        the raw logits' argmax (under a grammar's mask, if the request has one)."""
        return self.greedy and not self.logit_bias and self.repetition_penalty == 1 \
            and not self.frequency_penalty and not self.presence_penalty

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``ValueError`` naming the first parameter out of range; ``vocab_size`` also bounds
        token ids (``logit_bias``, ``stop_token_ids``)."""
        def fail(name: str, message: str) -> None:
            raise ValueError(f"{name} {message} (got {getattr(self, name)!r})")

        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            fail("max_new_tokens", "must be an integer >= 1")
        if not _is_number(self.temperature) or self.temperature < 0:
            fail("temperature", "must be a number >= 0")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            fail("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1 or self.top_k == 0:
            fail("top_k", "must be -1 (off) or an integer >= 1")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            fail("min_p", "must be in [0, 1]")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            fail("repetition_penalty", "must be a number > 0")
        for name in ("frequency_penalty", "presence_penalty"):
            if not _is_number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                fail(name, "must be in [-2, 2]")
        if self.seed is not None and not _is_int(self.seed):
            fail("seed", "must be an integer or null")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "must be a list of non-empty strings")
        if not isinstance(self.stop_regex, list) or not all(isinstance(s, str) and s for s in self.stop_regex):
            fail("stop_regex", "must be a list of non-empty regular expressions")
        for pattern in self.stop_regex:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"stop_regex {pattern!r} is not a valid Python regular expression: {exc}") from None
        if not isinstance(self.stop_token_ids, list) or not all(self._is_token_id(t, vocab_size)
                                                                for t in self.stop_token_ids):
            fail("stop_token_ids", "must be a list of token ids in the vocabulary")
        for name in ("ignore_eos", "logprobs", "skip_special_tokens", "prompt_logprobs"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "must be a boolean")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            fail("top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        if not _is_int(self.n) or self.n < 1:
            fail("n", "must be an integer >= 1")
        if self.prompt_logprobs is True and self.n != 1:
            fail("prompt_logprobs", "needs n = 1 (the samples of n > 1 share one computed prompt)")
        if not isinstance(self.logit_bias, dict):
            fail("logit_bias", "must map token ids to numbers")
        for token_id, bias in self.logit_bias.items():
            if not self._is_token_id(token_id, vocab_size):
                fail("logit_bias", f"has token id {token_id!r} outside the vocabulary")
            if not _is_number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                fail("logit_bias", f"has bias {bias!r} for token {token_id}; biases must be in "
                                   f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if self.json_schema is not None and not isinstance(self.json_schema, (str, dict)):
            fail("json_schema", "must be a JSON schema (an object or its JSON text)")
        for name in ("regex", "ebnf"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                fail(name, "must be a string")
        if self.structural_tag is not None and not isinstance(self.structural_tag, dict):
            fail("structural_tag", "must be a structural tag object")
        constraints = [n for n in CONSTRAINT_FIELDS if getattr(self, n) is not None]
        if len(constraints) > 1:
            raise ValueError(f"only one of {', '.join(CONSTRAINT_FIELDS)} may be given (got {', '.join(constraints)})")

    @staticmethod
    def _is_token_id(value: Any, vocab_size: int | None) -> bool:
        return _is_int(value) and value >= 0 and (vocab_size is None or value < vocab_size)
