"""``GrammarWorkers``: the threads that advance a step's grammars and fill its mask rows, a run of rows each.

A JSON-schema step at batch 64 accepts 64 tokens (~1-3 us each) and fills 64 bitmask rows (5-45 us
each: a row inside a string costs the most, where nearly every token is allowed and those holding a
quote are checked against the rest of the grammar). On one thread that is 1-3 ms, more than a small
model's whole decode step. xgrammar's own ``BatchGrammarMatcher`` fills rows on threads, but builds a
new thread pool on every call and joins it at the end (xgrammar 0.2.9's ``BatchFillNextTokenBitmask``),
so a step paid the threads' start on top of the fill. Here the threads live with the process, and a
step's work is split into interleaved runs, one a thread: each advances its run's grammars over their
tokens, then fills the rows still live, each part one native call over the whole run that releases the
GIL. The caller waits for the accepts (their verdicts finish requests) and then goes on with its own
Python work while the fills complete.

The GIL: a thread that wants it while the caller runs Python gets it only at the interpreter's switch
interval (5 ms). The caller waits for every run's accepts, so by then each thread has taken the GIL,
accepted and reported, and is a few bytecodes from its fill's native call, where it lets the GIL go;
nothing it does after that needs the GIL until the fill is done.

A run's rows are disjoint from every other run's, and so are its states: no two threads touch one
matcher or one mask row.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kiln.kernels.bitmask import ALL_ALLOWED

from .matcher import GrammarState

# Fewest rows worth a thread: waking one costs about as much as filling a few rows in place (on a
# 2-core CPU with a JSON schema mid-string, 2026-12-07: one row ~27 us, a handoff ~60 us).
MIN_ROWS_PER_RUN = 4
DEFAULT_MAX_THREADS = 8


def default_threads() -> int:
    """Half the CPUs this process may run on, at most ``DEFAULT_MAX_THREADS``: the scheduler shares its
    host with the API servers and the detokenizer."""
    return max(1, min(DEFAULT_MAX_THREADS, len(os.sched_getaffinity(0)) // 2))


@dataclass(frozen=True)
class RowWork:
    """One constrained request's share of a step: accept ``token`` (None: nothing to accept), then fill
    mask row ``row`` (None: none) if the grammar is still live."""

    state: GrammarState
    token: int | None = None
    row: int | None = None


class StepJob:
    """A step's accepts and fills under way: ``accepted`` gives the verdicts, ``wait`` the filled rows."""

    def __init__(self, work: list[RowWork], runs: int) -> None:
        self._work = work
        self._verdicts: list[bool] = [True] * len(work)
        self._runs_left = runs
        self._lock = threading.Lock()
        self._all_accepted = threading.Event()
        self._fills: list[Future] = []
        self._error: BaseException | None = None
        if runs == 0:
            self._all_accepted.set()

    def run(self, indices: list[int], bitmask: torch.Tensor) -> None:
        """Accepts then fills the work items at ``indices``: a run, on whichever thread calls it."""
        live: list[RowWork] = []
        try:
            accepting = [i for i in indices if self._work[i].token is not None]
            if accepting:
                verdicts = GrammarState.accept_tokens([self._work[i].state for i in accepting],
                                                      [self._work[i].token for i in accepting])
                for i, ok in zip(accepting, verdicts):
                    self._verdicts[i] = ok
            for i in indices:
                work = self._work[i]
                if work.row is None:
                    continue
                if work.token is None or (self._verdicts[i] and not work.state.is_terminated()):
                    live.append(work)
                else:
                    bitmask[work.row].fill_(ALL_ALLOWED)  # ended at this accept: its next token is dropped
        except BaseException as error:  # reaches the caller at accepted()
            self._error = error
            live = []
        self._ran_accepts()
        if live:
            GrammarState.fill_bitmasks([w.state for w in live], bitmask, [w.row for w in live])

    def _ran_accepts(self) -> None:
        with self._lock:
            self._runs_left -= 1
            if self._runs_left == 0:
                self._all_accepted.set()

    def accepted(self) -> list[bool]:
        """Per work item, whether its token was accepted (True where it had none): waits for every run's
        accepts, and raises their error, if any."""
        self._all_accepted.wait()
        if self._error is not None:
            raise self._error
        return self._verdicts

    def wait(self) -> None:
        """Waits for every run to end (accepts and fills); raises the first error."""
        for run in self._fills:
            run.result()
        if self._error is not None:
            raise self._error


class GrammarWorkers:
    """``threads`` threads, started on first use, that run a step's work in runs (``start``)."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = default_threads() if threads is None else threads
        self._pool: ThreadPoolExecutor | None = None

    def start(self, work: list[RowWork], bitmask: torch.Tensor) -> StepJob:
        """Starts the accepts and fills of ``work`` (rows of ``bitmask``): on the threads, a run each,
        or on this thread when there are fewer than ``MIN_ROWS_PER_RUN`` items."""
        runs = min(self.threads, len(work) // MIN_ROWS_PER_RUN)
        job = StepJob(work, max(runs, 1) if work else 0)
        if runs == 0:
            if work:
                job.run(list(range(len(work))), bitmask)
            return job
        pool = self._threads()
        job._fills = [pool.submit(job.run, list(range(first, len(work), runs)), bitmask) for first in range(runs)]
        return job

    def _threads(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="kiln-grammar")
        return self._pool

    def shutdown(self) -> None:
        """Lets the threads go (a step under way finishes first); the next ``start`` starts new ones."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
