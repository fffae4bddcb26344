"""What a submission gives back to its route: a ``RequestStream`` of ``SampleOutput`` deltas (text,
token ids, logprobs, finish reason) in arrival order, and the ``Usage`` that is complete once it
ends. The tokenizer manager fills the streams (``tokenizer_manager.py``); closing one aborts what is
left of its requests.

A stream hands out, as one delta, every delta of the same sample that has arrived since its route
last asked: a route that keeps up gets one delta a step, one that falls behind (the HTTP process's
CPU is the server's limit at a GPU's token rates) gets several steps' tokens in one delta, so one
SSE frame and one socket write instead of several. The text, token ids and logprobs are the same,
only cut into fewer chunks, as OpenAI's own streams cut them freely."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import APIError

if TYPE_CHECKING:
    from .tokenizer_manager import TokenizerManager


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token_bytes: bytes
    logprob: float
    top: tuple[tuple[int, bytes, float], ...] = ()


@dataclass(frozen=True)
class SampleOutput:
    """One delta of one sample: ``index`` of the ``n`` samples of prompt ``prompt_index``."""

    prompt_index: int
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    prompt_logprobs: list[float] = field(default_factory=list)  # on a sample's first delta, when asked
    matched_stop: int | str | None = None  # on a "stop" delta: the stop token id, string or regex that ended it


@dataclass(frozen=True)
class PromptEcho:
    """A prompt as ``echo`` returns it: its text and each token's bytes."""

    text: str
    token_bytes: list[bytes]


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    spec_verify_ct: int = 0        # speculative decoding: the samples' verify steps (see runtime.outputs.Usage)
    spec_verify_tokens: int = 0


class RequestStream:
    """The outputs of one submission, in arrival order; ``usage`` is complete once it ends."""

    def __init__(self, manager: "TokenizerManager", samples: int, max_tokens_param: str) -> None:
        self.manager = manager
        self.rids: list[str] = []
        self.max_tokens_param = max_tokens_param
        self.usage = Usage()
        self._items: deque[SampleOutput | APIError] = deque()
        self._arrived = asyncio.Event()
        self._pending = samples
        self._prompts_counted: set[int] = set()

    def put(self, item: SampleOutput | APIError) -> None:
        self._items.append(item)
        self._arrived.set()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> SampleOutput:
        if self._pending == 0:
            raise StopAsyncIteration
        while not self._items:
            self._arrived.clear()
            await self._arrived.wait()
        item = self._items.popleft()
        if isinstance(item, APIError):
            self._pending = 0
            raise item
        while item.finish_reason is None and self._items and _same_sample(item, self._items[0]):
            item = _joined(item, self._items.popleft())
        self.usage.completion_tokens += len(item.token_ids)
        if item.finish_reason is not None:
            self._pending -= 1
        return item

    def note_prompt(self, prompt_index: int, index: int, prompt_tokens: int, cached_tokens: int) -> None:
        # All samples of a prompt share it. Sample 0 leads: the others reuse the prompt KV it cached,
        # so its cache hit is the request's (as the in-process Engine reports it).
        if index == 0 and prompt_index not in self._prompts_counted:
            self._prompts_counted.add(prompt_index)
            self.usage.prompt_tokens += prompt_tokens
            self.usage.cached_tokens += cached_tokens

    def close(self) -> None:
        """Ends the stream's requests: those still running are aborted (idempotent)."""
        self.manager.release(self)


def _same_sample(item: SampleOutput, following: SampleOutput | APIError) -> bool:
    return isinstance(following, SampleOutput) and (following.prompt_index, following.index) == \
        (item.prompt_index, item.index)


def _joined(first: SampleOutput, then: SampleOutput) -> SampleOutput:
    """Two consecutive deltas of one sample as one (``first`` has no finish reason)."""
    return SampleOutput(first.prompt_index, first.index, first.text + then.text, first.token_ids + then.token_ids,
                        first.logprobs + then.logprobs, then.finish_reason,
                        first.prompt_logprobs or then.prompt_logprobs, then.matched_stop)
