"""The output side of one request: collects the core's sample events into completions (text,
tokens, logprobs, finish reasons) and passes deltas to whoever listens.

``on_event`` runs on the engine's thread; ``wait`` is for the caller's. Listeners are callbacks
so the same handle serves blocking iterators, asyncio queues and plain waiting.
"""

from __future__ import annotations

import threading
from typing import Callable

from .outputs import Completion, RequestOutput, SampleEvent, StreamDelta, Usage
from .sampling import SamplingParams
from .text.text_stream import SampleText
from .text.tokenizer import Tokenizer


class RequestHandle:
    def __init__(self, rid: str, prompt_ids: list[int], params: SamplingParams, tokenizer: Tokenizer | None,
                 on_delta: Callable[[StreamDelta | None], None] | None = None,
                 on_finish: Callable[[RequestOutput | BaseException], None] | None = None) -> None:
        self.rid = rid
        self.prompt_ids = prompt_ids
        self.params = params
        self._texts = [SampleText(tokenizer, prompt_ids, params) for _ in range(params.n)] if tokenizer else None
        self._completions = [Completion(i, logprobs=[] if params.logprobs or params.top_logprobs else None)
                             for i in range(params.n)]
        self._on_delta = on_delta
        self._on_finish = on_finish
        self._done = threading.Event()
        self._cached_tokens = 0
        self._spec_counts = [(0, 0)] * params.n  # per sample: (verify steps, their tokens)
        self.result: RequestOutput | None = None
        self.error: BaseException | None = None

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def on_event(self, event: SampleEvent) -> bool:
        """Applies one event; returns True once every sample has finished."""
        completion = self._completions[event.index]
        completion.token_ids.extend(event.token_ids)
        if completion.logprobs is not None:
            completion.logprobs.extend(event.logprobs)
        finished = event.finish_reason is not None
        text = self._texts[event.index].push(event.token_ids, finished) if self._texts else ""
        completion.text += text
        if event.index == 0:
            self._cached_tokens = event.cached_tokens
        if event.spec_verify_ct:
            self._spec_counts[event.index] = (event.spec_verify_ct, event.spec_verify_tokens)
        if finished:
            completion.finish_reason = event.finish_reason
            completion.matched_stop = event.matched_stop
            completion.stop_string = self._texts[event.index].stop_string if self._texts else None
        all_done = all(c.finish_reason is not None for c in self._completions)
        usage = self._usage() if all_done else None
        if self._on_delta is not None:
            self._on_delta(StreamDelta(self.rid, event.index, text, event.token_ids, event.logprobs,
                                       event.finish_reason, usage))
        if event.error is not None:
            # Errors the core reports for one request are about that request's input (a bad grammar).
            self.fail(ValueError(event.error))
            return True
        if all_done:
            self.result = RequestOutput(self.rid, self.prompt_ids, self._completions, usage)
            self._finish(self.result)
        return all_done

    def fail(self, error: BaseException) -> None:
        if self._done.is_set():
            return
        self.error = error
        self._finish(error)

    def wait(self, timeout: float | None = None) -> RequestOutput:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.rid} did not finish in {timeout} s")
        if self.error is not None:
            raise self.error
        return self.result

    def _usage(self) -> Usage:
        completion_tokens = sum(len(c.token_ids) for c in self._completions)
        return Usage(len(self.prompt_ids), completion_tokens, self._cached_tokens,
                     sum(c for c, _ in self._spec_counts), sum(t for _, t in self._spec_counts))

    def _finish(self, outcome: RequestOutput | BaseException) -> None:
        self._done.set()
        if self._on_finish is not None:
            self._on_finish(outcome)
        if self._on_delta is not None:
            self._on_delta(None)
