"""What the engine hands back: per-token events from the core, and the finished outputs users see."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


# How SampleEvent.error starts when the failure is the engine's fault, not the request's (a
# server answers it with a 500; a request's own errors, a grammar that fails, are 400s).
INTERNAL_ERROR = "internal error: "

# How EngineCore.stats() names a MoE model's tokens per expert: ``expert_tokens:{layer}:{expert}``
# (flat keys, so the stats stay one name -> number map that data-parallel replicas sum).
EXPERT_TOKENS = "expert_tokens:"


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()   # (token id, logprob) of the most likely alternatives


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # Speculative decoding (0 without): the verify steps the samples took part in and the tokens
    # those steps gave them (SGLang's meta_info spec_verify_ct; their ratio the mean accepted length).
    spec_verify_ct: int = 0
    spec_verify_tokens: int = 0

    @property
    def spec_accept_length(self) -> float:
        """Tokens per verify step, the accepted drafts and the target's own token (0 without speculation)."""
        return self.spec_verify_tokens / self.spec_verify_ct if self.spec_verify_ct else 0.0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class SampleEvent(NamedTuple):
    """What one step did for one sample (``index`` of ``n``) of request ``rid``.

    Immutable like the other records here, but a NamedTuple rather than a frozen dataclass: the
    engine core builds one per running sample every step, and a frozen dataclass's ``__init__``
    (one ``object.__setattr__`` per field) costs ~5x as much, ~0.5 ms a step at batch 256."""

    rid: str
    index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None      # "stop", "length", "abort", or None while running
    error: str | None = None               # set when the request failed (finish_reason "abort")
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # This sample's verify steps so far and the tokens they gave it (speculative decoding; see Usage).
    spec_verify_ct: int = 0
    spec_verify_tokens: int = 0
    # With SamplingParams.prompt_logprobs, on the first token's event: prompt tokens 1.. scored.
    prompt_logprobs: tuple[float, ...] = ()
    # On a "stop" event: what ended the sample (SGLang's matched_stop): the stop token id (EOS among
    # them), the stop string, or the stop regex's pattern.
    matched_stop: int | str | None = None


@dataclass
class Completion:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    stop_string: str | None = None
    matched_stop: int | str | None = None  # see SampleEvent.matched_stop


@dataclass
class RequestOutput:
    rid: str
    prompt_token_ids: list[int]
    completions: list[Completion]
    usage: Usage

    @property
    def text(self) -> str:
        return self.completions[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.completions[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.completions[0].finish_reason


@dataclass(frozen=True)
class StreamDelta:
    """A streamed piece of one sample: new text (possibly empty), its tokens, and the finish reason
    on the last delta."""

    rid: str
    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    usage: Usage | None = None
