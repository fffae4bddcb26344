"""Start-up phases and their times, so that a slow start says where its seconds went.

Each process times its own phases where they run (``StartupTimer``): ``kiln serve``'s HTTP process
(``imports`` of the CLI, ``artifact``, ``server_imports``, ``tokenizer``, ``http_ready``), each
scheduler process (``spawn``, ``imports``, then the engine core's ``artifact_read``, ``tokenizer``,
``weights_load``, ``kernel_load``, ``kv_pool``, ``kernel_warmup`` and ``graph_capture``) and the
detokenizer (``spawn``, ``imports``, ``tokenizer``). Every phase is logged as it ends; the children
send theirs with READY, and the HTTP process gathers them into one ``StartupReport``, which it logs
as a summary and serves in ``/health``'s JSON and as ``kiln_startup_seconds`` in ``/metrics``.

A phase is an interval of the wall clock (``time.time()``, which every process on the host
shares), so phases of different processes can be laid side by side: they overlap where the
processes work at once. ``spawn`` is the time from the parent's ``Popen`` to the child's own start
(``process_started_at``), ``imports`` from there to its ``main``. Plain Python: the HTTP process
imports this without torch.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Iterator

log = logging.getLogger("kiln.startup")


@dataclass(frozen=True)
class Phase:
    name: str
    process: str       # "http", "scheduler" (replica i > 0: "scheduler{i}"), "detokenizer", "engine"
    start: float       # wall clock, time.time()
    seconds: float

    @property
    def end(self) -> float:
        return self.start + self.seconds

    def to_wire(self) -> list[Any]:
        return [self.name, self.process, self.start, self.seconds]

    @classmethod
    def from_wire(cls, item: list[Any]) -> "Phase":
        name, process, start, seconds = item
        return cls(str(name), str(process), float(start), float(seconds))


class StartupTimer:
    """One process's phases, in the order they ended; each is logged (at info) when it ends."""

    def __init__(self, process: str) -> None:
        self.process = process
        self.phases: list[Phase] = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Times the block; one that raises is not recorded (its error says what happened)."""
        start = time.time()
        yield
        self.add(name, start, time.time() - start)

    def add(self, name: str, start: float, seconds: float) -> None:
        """A phase timed elsewhere (a sum of pieces, or one that began before this timer existed)."""
        phase = Phase(name, self.process, start, seconds)
        self.phases.append(phase)
        log.info("start-up: %s %s %.2f s", self.process, name, seconds)

    def since(self, name: str, start: float) -> None:
        """A phase from ``start`` until now."""
        self.add(name, start, time.time() - start)

    def seconds(self, name: str) -> float:
        """The phase ``name``'s seconds (0.0 when it did not run)."""
        return sum(p.seconds for p in self.phases if p.name == name)

    def to_wire(self) -> list[list[Any]]:
        return [phase.to_wire() for phase in self.phases]


@functools.cache  # one reading: two would differ by the clocks' jitter
def process_started_at() -> float:
    """When this process started (wall clock), to about 10 ms: Linux's /proc knows; elsewhere, the
    first call's time."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            # The command name (field 2) may hold spaces: fields counted after its closing ')'.
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
            since_boot = float(uptime.read().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - (since_boot - start_ticks / os.sysconf("SC_CLK_TCK"))


def process_phases(process: str, main_at: float, spawned_at: float | None = None) -> StartupTimer:
    """A process's timer, opened with its ``spawn`` (a child's: from the parent's ``Popen`` at
    ``spawned_at``; left out when not given) and ``imports`` (from its start until ``main_at``)."""
    timer = StartupTimer(process)
    started = process_started_at()
    if spawned_at is not None:
        started = max(started, spawned_at)  # /proc's clock ticks are coarse; never before the Popen
        timer.add("spawn", spawned_at, started - spawned_at)
    timer.add("imports", started, max(0.0, main_at - started))
    return timer


@dataclass(frozen=True)
class StartupReport:
    """Every process's phases, from ``origin`` (the server process's start) to ``ready_at`` (HTTP
    listening): what ``/health`` and ``/metrics`` show and the summary logs."""

    origin: float
    ready_at: float
    phases: tuple[Phase, ...]

    @property
    def seconds(self) -> float:
        return self.ready_at - self.origin

    def to_wire(self) -> list[Any]:
        """As plain data, for another API server (``--api-server-count``)."""
        return [self.origin, self.ready_at, [p.to_wire() for p in self.phases]]

    @classmethod
    def from_wire(cls, item: list[Any]) -> "StartupReport":
        origin, ready_at, phases = item
        return cls(float(origin), float(ready_at), tuple(Phase.from_wire(p) for p in phases))

    def to_json(self) -> dict[str, Any]:
        """``{"seconds": total, "phases": [{"name", "process", "start" (s after origin), "seconds"}]}``."""
        return {"seconds": round(self.seconds, 4),
                "phases": [{"name": p.name, "process": p.process, "start": round(p.start - self.origin, 4),
                            "seconds": round(p.seconds, 4)} for p in self._ordered()]}

    def summary(self) -> str:
        """One line: the total, then each phase as process/name seconds@start, in start order."""
        parts = [f"{p.process}/{p.name} {p.seconds:.2f}@{p.start - self.origin:.2f}" for p in self._ordered()]
        return f"ready in {self.seconds:.2f} s: " + ", ".join(parts)

    def metric_lines(self) -> list[str]:
        """``kiln_startup_seconds{phase, process}`` per phase, and the total as ``phase="ready"``."""
        lines = ["# HELP kiln_startup_seconds Seconds of each start-up phase, by process; phase=\"ready\": from "
                 "the server process's start to HTTP listening", "# TYPE kiln_startup_seconds gauge"]
        lines += [f'kiln_startup_seconds{{phase="{p.name}",process="{p.process}"}} {p.seconds!r}'
                  for p in self._ordered()]
        return lines + [f'kiln_startup_seconds{{phase="ready",process="http"}} {self.seconds!r}']

    def _ordered(self) -> list[Phase]:
        return sorted(self.phases, key=lambda p: (p.start, p.end))
