"""A request as the scheduler sees it: its tokens, its KV pages, and where it is in its life.

States: WAITING (queued, holds no KV) -> PREFILLING (some prompt chunks computed) -> DECODING (one
new token a step) -> FINISHED or ABORTED. Retraction moves a PREFILLING/DECODING request back to
WAITING, keeping the tokens it generated, so it resumes where it was.

KV bookkeeping: ``pages`` cover the first ``num_computed`` tokens of ``all_ids``; the first
``len(prefix.pages)`` of them are borrowed from the radix tree (``prefix.node`` is locked), the
rest belong to the request.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any, Hashable

from ..kvcache.radix import PrefixMatch
from ..sampling.params import SamplingParams


class RequestState(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    ABORTED = "aborted"


# The states that per-step loops check on every running request, as module names: Python 3.11's enum
# metaclass defines __getattr__, which makes reading a member off its class (RequestState.DECODING)
# ~4x slower than a plain attribute, as slow as a function call.
PREFILLING, DECODING = RequestState.PREFILLING, RequestState.DECODING
_ENDED = (RequestState.FINISHED, RequestState.ABORTED)

_arrival = itertools.count()
# The output slot of a token still being computed on the device: an overlapped step is launched with
# its input taken from the previous step's device output before the host has read that token. The
# slot is filled within the same EngineCore.step, so no release, abort or cache insert ever sees it.
PENDING = -1


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    index: int = 0                   # which of the request's n samples this is
    namespace: Hashable = None
    # Its LoRA adapter (a runtime.lora LoraEntry; None: the base model), and the device slot the
    # scheduler pinned for it while it runs (-1: none), which the step's lora_slot column carries.
    lora: Any = None
    lora_slot: int = -1
    # A request of an n > 1 group waits for its leader's prompt to be cached, then shares its pages.
    leader: "Request | None" = None
    # Per-sample state the engine core keeps (stop-string watch, grammar state); the scheduler only carries it.
    extras: dict[str, Any] = field(default_factory=dict)

    state: RequestState = RequestState.WAITING
    output_ids: list[int] = field(default_factory=list)
    arrival: int = field(default_factory=lambda: next(_arrival))
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    prefix: PrefixMatch | None = None
    cached_tokens: int = 0           # tokens the first admission found in the cache (for usage)
    prompt_inserted: bool = False    # the computed prompt is in the radix tree
    retractions: int = 0
    finish_reason: str | None = None
    # With params.prompt_logprobs: the logprob of prompt token i + 1 given tokens 0..i, filled as
    # the prompt's chunks run (every prompt position is computed: no prefix comes from the cache).
    prompt_logprobs: list[float] = field(default_factory=list)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """``all_ids[start:end]`` without building ``all_ids`` (a decode step needs one token, and
        copying a long prompt for it every step is the hot path's largest cost)."""
        split = len(self.prompt_ids)
        if end <= split:
            return self.prompt_ids[start:end]
        if start >= split:
            return self.output_ids[start - split:end - split]
        return self.prompt_ids[start:] + self.output_ids[:end - split]

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        """Tokens whose KV is not computed yet (the last one is the next step's input)."""
        return self.total_len - self.num_computed

    @property
    def done(self) -> bool:
        return self.state in _ENDED

    @property
    def owned_pages(self) -> list[int]:
        borrowed = len(self.prefix.pages) if self.prefix is not None else 0
        return self.pages[borrowed:]
