"""Constrained decoding in the engine core: compiling requests' grammars off the loop, holding the
requests until their grammar is ready, and masking and advancing them each step.

A constrained request is not queued for scheduling until its grammar has compiled (on the grammar
compiler's thread pool; the loop only polls the future), so a slow or bad constraint never delays
other requests; a bad one ends that request alone with an error. Each sample keeps its
``GrammarState`` in ``request.extras["grammar"]`` across retraction: the scheduler keeps a retracted
request's output tokens, so the state stays in step with them.

Per step, the constrained rows are served as one batch: ``mask`` fills all their bitmask rows in one
call (on up to ``grammar_threads`` of xgrammar's threads) into a buffer reused from step to step
(``StepMasks``: pinned, one non-blocking copy to the device), and ``advance_all`` moves all their
grammars over the step's tokens in one pass.
The engine fills the mask right after launching the step's forward, so on a GPU it is built while
the forward runs. Overlapped decode steps go further (``start_mask``): step N+1's forward runs while
step N's tokens are accepted, N+1's mask is filled on a thread while the host applies N's tokens and
hands out the events, and N+1's tokens are drawn at the start of the next step.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .sampling import SamplingParams
from .sampling.params import CONSTRAINT_FIELDS
from .scheduler.request import Request
from .text.tokenizer import Tokenizer

if TYPE_CHECKING:  # (the grammar modules import xgrammar: loaded on the first constrained request)
    from .grammar.step_mask import PendingMask

GRAMMAR = "grammar"


def constraint_of(params: SamplingParams) -> tuple[str, Any] | None:
    """The (kind, constraint) a request asks for, if any."""
    for kind in CONSTRAINT_FIELDS:
        value = getattr(params, kind)
        if value is not None:
            return kind, value
    return None


@dataclass
class _Pending:
    samples: list[Request]
    kind: str
    future: Future
    deadline: float


class Constraints:
    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_ids: set[int], timeout_s: float = 30.0,
                 grammar_threads: int | None = None) -> None:
        if grammar_threads is not None and grammar_threads < 1:
            raise ValueError(f"grammar_threads: must be at least 1, got {grammar_threads}")
        self._tokenizer = tokenizer
        self._grammar_threads = grammar_threads
        self._vocab_size = vocab_size
        self._eos_ids = eos_ids
        self._timeout_s = timeout_s
        self._compiler = None
        self._pending: list[_Pending] = []
        self._masks = None  # StepMasks, made on the first constrained step (it imports xgrammar)

    def start(self, samples: list[Request]) -> None:
        """Begins compiling the samples' shared constraint; they are released by ``poll``."""
        kind, value = constraint_of(samples[0].params)
        future = self._grammar_compiler().compile_async(kind, value)
        self._pending.append(_Pending(samples, kind, future, time.monotonic() + self._timeout_s))

    def poll(self) -> tuple[list[Request], list[tuple[list[Request], str]]]:
        """Requests whose grammar is ready (to schedule), and those that failed with the error."""
        from .grammar import GrammarError, GrammarState

        ready, failed, still = [], [], []
        for pending in self._pending:
            if not pending.future.done() and time.monotonic() < pending.deadline:
                still.append(pending)
                continue
            try:
                grammar = self._compiler.result(pending.future, pending.kind, timeout=0)
            except GrammarError as error:
                failed.append((pending.samples, str(error)))
                continue
            for sample in pending.samples:
                stops = self._eos_ids | set(sample.params.stop_token_ids)
                sample.extras[GRAMMAR] = GrammarState(grammar, stops)
            ready.extend(pending.samples)
        self._pending = still
        return ready, failed

    def has_pending(self) -> bool:
        return bool(self._pending)

    def cancel(self, rid: str) -> list[Request]:
        """Drops a pending request's samples (it was aborted before its grammar compiled)."""
        dropped = [p for p in self._pending if p.samples[0].rid == rid]
        self._pending = [p for p in self._pending if p.samples[0].rid != rid]
        return [s for p in dropped for s in p.samples]

    @staticmethod
    def any_constrained(requests: list[Request]) -> bool:
        return any(GRAMMAR in r.extras for r in requests)

    def mask(self, requests: list[Request], logits: torch.Tensor) -> torch.Tensor | None:
        """The packed bitmask of a step's sampled rows (``logits``' rows), on the logits' device, or
        None when no row is constrained. Rows of finished requests (an overlapped step ran one past
        their end) allow everything: their tokens are dropped. Valid until the next ``mask``."""
        pending = self.start_mask(requests, logits, background=False)
        return None if pending is None else pending.wait()

    def start_mask(self, requests: list[Request], logits: torch.Tensor,
                   background: bool = True) -> PendingMask | None:
        """``mask``, filled on a thread (``background``): a ``PendingMask`` whose ``wait`` gives it, or
        None. The requests' grammars must not move until then. A request whose grammar has ended is
        skipped even before the engine marks it done (its token is dropped)."""
        states = [None if r.done or (state := r.extras.get(GRAMMAR)) is None or state.is_terminated() else state
                  for r in requests]
        if not any(states):
            return None
        if self._masks is None or self._masks.device != logits.device or self._masks.vocab_size != logits.shape[1]:
            from .grammar.step_mask import StepMasks

            self._masks = StepMasks(logits.shape[1], logits.device, self._grammar_threads)
        return self._masks.start(states, background)

    @staticmethod
    def advance_all(requests: list[Request], tokens: list[int]) -> list[str | None] | None:
        """Moves every live constrained request's grammar over its token (``tokens[i]`` is
        ``requests[i]``'s), all in one pass; per row the finish reason that gives ("stop": the grammar
        ended, "error": it rejected the token; None: go on, or no grammar), or None when no row has a
        live grammar. Finished rows (an overlapped step ran one past their end) are left alone."""
        live = [(row, state) for row, request in enumerate(requests)
                if not request.done and (state := request.extras.get(GRAMMAR)) is not None]
        if not live:
            return None
        from .grammar.matcher import GrammarState

        accepted = GrammarState.accept_tokens([state for _, state in live], [tokens[row] for row, _ in live])
        reasons: list[str | None] = [None] * len(requests)
        for (row, state), ok in zip(live, accepted):
            reasons[row] = "error" if not ok else "stop" if state.is_terminated() else None
        return reasons

    @staticmethod
    def advance(request: Request, token: int) -> str | None:
        """``advance_all`` for one request: its finish reason after ``token``."""
        state = request.extras.get(GRAMMAR)
        if state is None:
            return None
        if not state.accept(token):
            return "error"
        return "stop" if state.is_terminated() else None

    def _grammar_compiler(self):
        if self._compiler is None:
            from .grammar import GrammarCompiler

            if self._tokenizer is None:
                raise ValueError("json_schema/regex/ebnf: constrained decoding needs a tokenizer, and this "
                                 "artifact has none")
            self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size, stop_token_ids=self._eos_ids,
                                             timeout_s=self._timeout_s)
        return self._compiler
