"""``GrammarState``: one constrained request's position in its grammar, over the tokens it produced.

Each decode step the engine asks the state for the row of allowed next tokens (``fill_bitmask``),
samples under that mask, then feeds the chosen token back (``accept``). The state wraps an
``xgrammar.GrammarMatcher``, a pushdown automaton that lives on the CPU and advances per token. A
step's constrained rows are served together: ``fill_bitmasks`` fills all their masks in one call
(on xgrammar's threads, as many as the rows are worth) and ``accept_tokens`` advances all their
states in one tight loop, with termination tracked here rather than asked of the matcher row by row.

Stop tokens (end of sequence) are part of the grammar's language: the mask allows them only where
the constrained text may end, and once the text is complete it allows nothing else. Accepting a stop
token terminates the state (``is_terminated``); the request then finishes with reason "stop".

Retraction: the scheduler keeps a retracted request's output tokens, so the state, kept with the
request, stays valid and the resumed request continues unchanged. Where the tokens and the state part
ways, the state is brought back in line: ``rollback(n)`` undoes the last n accepted tokens
(speculative drafts the verifier rejected), and ``GrammarState.replay`` rebuilds a state from a
request's output tokens (a state that was dropped); both give exactly the masks the original had.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch
import xgrammar

logger = logging.getLogger(__name__)

# Rows a fill thread takes. xgrammar 0.2.9's batch fill starts its threads on every call and joins them
# at the end; on the 16-core GPU host (2026-12-07) each thread added ~60 us, while a row of a JSON
# schema costs 3-30 us (the most inside a string): 64 rows filled fastest on about 4 threads.
ROWS_PER_FILL_THREAD = 16


class GrammarState:
    """The grammar position of one request. ``stop_token_ids`` replace the compiler's stop tokens
    for this request (e.g. the tokenizer's EOS plus the request's own ``stop_token_ids``)."""

    def __init__(self, grammar: xgrammar.CompiledGrammar, stop_token_ids: Iterable[int] | None = None) -> None:
        stops = sorted(set(stop_token_ids)) if stop_token_ids is not None else None
        if stops is not None and not stops:
            raise ValueError("a constrained request needs at least one stop token to end its output")
        self.grammar = grammar
        self.stop_token_ids = stops
        self._matcher = xgrammar.GrammarMatcher(grammar, override_stop_tokens=stops)
        # The matcher terminates exactly when it accepts one of its stop tokens (and a rollback past
        # that token revives it): tracked here, so checking a step's rows costs no native call each.
        self._stops = frozenset(self._matcher.stop_token_ids)
        self._terminated = False
        self._num_accepted = 0

    @classmethod
    def replay(cls, grammar: xgrammar.CompiledGrammar, token_ids: Iterable[int],
               stop_token_ids: Iterable[int] | None = None) -> "GrammarState":
        """A state that has accepted ``token_ids`` (a request's output so far), as the original had."""
        state = cls(grammar, stop_token_ids)
        for position, token_id in enumerate(token_ids):
            if not state.accept(token_id):
                raise ValueError(f"cannot replay the grammar: output token {position} (id {token_id}) "
                                 "does not follow it")
        return state

    @property
    def num_accepted(self) -> int:
        """Tokens accepted so far (a final stop token included)."""
        return self._num_accepted

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into ``bitmask[row]`` (a CPU int32 tensor from
        ``allocate_bitmask``). Returns False when every token is allowed, so the row needs no masking."""
        self._require_live()
        return self._matcher.fill_next_token_bitmask(bitmask, row)

    @staticmethod
    def fill_bitmasks(states: "list[GrammarState]", bitmask: torch.Tensor, rows: list[int], threads: int = 1) -> None:
        """``fill_bitmask`` for many states at once, on up to ``threads`` threads (xgrammar's batch fill,
        outside the GIL): one thread per ``ROWS_PER_FILL_THREAD`` rows, since each costs as much as a few
        rows' fill to start."""
        if len(states) == 1:
            states[0].fill_bitmask(bitmask, rows[0])
            return
        for state in states:
            state._require_live()
        fill_threads = max(1, min(threads, -(-len(states) // ROWS_PER_FILL_THREAD)))
        _batch_matcher(fill_threads).batch_fill_next_token_bitmask([s._matcher for s in states], bitmask, rows)

    def _require_live(self) -> None:
        if self._terminated:
            raise RuntimeError("the grammar has terminated (its stop token was accepted): the request "
                               "should have finished, and has no next token to mask")

    def accept(self, token_id: int) -> bool:
        """Advance over the sampled token. False (state unchanged) means the token breaks the
        grammar, which a token the mask allowed never does: the engine should abort the request."""
        return self._accepted(token_id, self._matcher.accept_token(token_id))

    @staticmethod
    def accept_tokens(states: "list[GrammarState]", token_ids: list[int]) -> list[bool]:
        """``accept`` for many states at once, ``states[i]`` over ``token_ids[i]``: a whole step's
        constrained rows in one tight loop. (xgrammar's ``BatchGrammarMatcher.batch_accept_token``
        also advances the matchers one after another, and converting its arguments costs more than
        the loop: in xgrammar 0.2.9, 92 against 74 µs for 64 rows of a JSON schema.)"""
        return [state._accepted(token_id, state._matcher.accept_token(token_id))
                for state, token_id in zip(states, token_ids)]

    def _accepted(self, token_id: int, ok: bool) -> bool:
        """Book-keeping after the matcher saw ``token_id``: counts and termination, or the warning."""
        if ok:
            self._num_accepted += 1
            self._terminated = token_id in self._stops
            return True
        logger.warning("grammar rejected token %d after %d accepted tokens%s", token_id, self._num_accepted,
                       " (it had already terminated)" if self._terminated else
                       " (was the mask applied to its row?)")
        return False

    def is_terminated(self) -> bool:
        """A stop token was accepted: the constrained output is finished."""
        return self._terminated

    def is_completed(self) -> bool:
        """The text so far is a complete match, so a stop token is allowed next."""
        return self._matcher.is_completed()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (a terminated state becomes live again)."""
        if not 0 <= num_tokens <= self._num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._num_accepted} were accepted")
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self._num_accepted -= num_tokens
            self._terminated = self._matcher.is_terminated()


_BATCH_MATCHERS: dict[int, xgrammar.BatchGrammarMatcher] = {}


def _batch_matcher(threads: int) -> xgrammar.BatchGrammarMatcher:
    """The process's batch filler on ``threads`` threads (xgrammar starts and joins them in each call)."""
    if threads not in _BATCH_MATCHERS:
        _BATCH_MATCHERS[threads] = xgrammar.BatchGrammarMatcher(threads)
    return _BATCH_MATCHERS[threads]
