"""Where a replay's wall time goes, kernel by kernel: the critical path of a trace of device kernels.

Summing kernel durations (``step_breakdown.kernel_table``) overstates a step whose kernels overlap:
under programmatic dependent launch a kernel starts while the one before it drains and then waits,
so its duration includes that wait. This module instead walks the kernels in start order and
charges each one only for what it adds to the end of the work so far:

- ``critical``: how far its end moves the frontier (the latest end of every kernel before it);
  summed over a replay, with ``idle``, it is the replay's span;
- ``idle``: time with no kernel running before it starts (launch gaps);
- ``duration``: its own start to end, for comparison.

Kernels of the same name are told apart by the kernel before them (a layer's GEMVs all run one
kernel: the one after attention is the o projection, the one after the SiLU gate the down one).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class Kernel:
    name: str
    start_us: float
    end_us: float


@dataclass
class PathShare:
    calls: int = 0
    critical_us: float = 0.0
    idle_us: float = 0.0
    duration_us: float = 0.0


def _short(name: str, width: int = 36) -> str:
    return name if len(name) <= width else name[:width - 3] + "..."


def critical_path(kernels: list[Kernel]) -> dict[str, PathShare]:
    """Each kernel's share of the span of ``kernels`` (any order), keyed ``"name (after previous)"``
    with both names cut to a table's width."""
    shares: dict[str, PathShare] = defaultdict(PathShare)
    frontier = None
    previous = "start"
    for kernel in sorted(kernels, key=lambda k: (k.start_us, k.end_us)):
        share = shares[f"{_short(kernel.name)} (after {_short(previous)})"]
        share.calls += 1
        share.duration_us += kernel.end_us - kernel.start_us
        if frontier is None:
            share.critical_us += kernel.end_us - kernel.start_us
            frontier = kernel.end_us
        else:
            share.idle_us += max(0.0, kernel.start_us - frontier)
            share.critical_us += max(0.0, kernel.end_us - max(frontier, kernel.start_us))
            frontier = max(frontier, kernel.end_us)
        previous = kernel.name
    return dict(shares)


def critical_path_table(kernels: list[Kernel], steps: int, top: int) -> str:
    """A markdown table of ``critical_path`` per replay (``steps`` replays in the trace), the ``top``
    rows by critical time first."""
    shares = critical_path(kernels)
    span = sum(s.critical_us + s.idle_us for s in shares.values()) / steps
    lines = [f"critical path: {span:.1f} us per replay",
             "| kernel (after) | calls/step | critical us/step | critical us/call | idle us/step | duration us/call |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, s in sorted(shares.items(), key=lambda kv: -kv[1].critical_us)[:top]:
        lines.append(f"| {name} | {s.calls / steps:.3g} | {s.critical_us / steps:.1f} | {s.critical_us / s.calls:.2f} "
                     f"| {s.idle_us / steps:.1f} | {s.duration_us / s.calls:.2f} |")
    return "\n".join(lines)
