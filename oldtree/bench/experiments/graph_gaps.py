"""What an engine step runs on the GPU besides its decode graph, and how long the GPU waits between graphs.

A decode step is one CUDA-graph replay plus whatever the engine queues around it on the compute
stream. Before decode graphs took two turns (``kiln/runtime/worker/decode_graphs.py``) that was the staged
inputs' host-to-device copy and the tokens' copy back to the host; each is a separate stream
operation, and the next replay's first kernel starts only after them, so at batch 1 of a small
model they were a visible share of a step. Now the inputs' copy runs on a copy stream during the
previous replay (skipped here, see ``find_replays``), and what is left between two replays shows
what still serializes with them (an overlapped step's reordered or sampled ids, for one).

``between_graphs`` finds every replay in a trace of engine steps (a run of device events whose names
are the replay's kernels in order), then charges the time from one replay's last end to the next
replay's first start to the operations in between, as ``timeline.critical_path`` does within one.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from timeline import Kernel, PathShare, critical_path

NEXT = "(next graph)"


@dataclass(frozen=True)
class Between:
    """``gaps_us``: from each replay's end to the next one's start; ``shares``: what ran there."""
    gaps_us: list[float]
    shares: dict[str, PathShare]


def find_replays(events: list[Kernel], graph_names: list[str]) -> list[tuple[int, int]]:
    """``(first, past_last)`` indices into ``events`` (sorted by start) of each replay's kernels. Events
    of other names inside a replay are operations on other streams that overlap it (the next step's
    input copy on the copy stream): skipped, and not charged to any gap."""
    found, i, size = [], 0, len(graph_names)
    names = [e.name for e in events]
    own = set(graph_names)
    while size and i + size <= len(events):
        j, matched = i, 0
        while j < len(events) and matched < size:
            if names[j] == graph_names[matched]:
                matched += 1
            elif matched == 0 or names[j] in own:
                break  # no replay starts here, or the graph's kernels come out of order
            j += 1
        if matched == size:
            found.append((i, j))
            i = j
        else:
            i += 1
    return found


def between_graphs(events: list[Kernel], graph_names: list[str]) -> Between:
    """The gaps between consecutive replays of ``graph_names`` in ``events`` and the operations in them."""
    ordered = sorted(events, key=lambda e: (e.start_us, e.end_us))
    replays = find_replays(ordered, graph_names)
    gaps: list[float] = []
    shares: dict[str, PathShare] = defaultdict(PathShare)
    own = set(graph_names)
    for (start, last), (first, _) in zip(replays, replays[1:]):
        graph_end = max(e.end_us for e in ordered[start:last] if e.name in own)
        gaps.append(ordered[first].start_us - graph_end)
        # A zero-length marker at the replay's end, so that the operations are charged from there on.
        # Zero-length markers at the replay's end and the next one's start, so that the operations are
        # charged from the first on and the wait after them shows as the second's idle time.
        next_start = ordered[first].start_us
        markers = Kernel("(graph)", graph_end, graph_end), Kernel(NEXT, next_start, next_start)
        for name, share in critical_path([markers[0], *ordered[last:first], markers[1]]).items():
            if name != "(graph) (after start)":
                total = shares[name]
                total.calls += share.calls
                total.critical_us += share.critical_us
                total.idle_us += share.idle_us
                total.duration_us += share.duration_us
    return Between(gaps, dict(shares))


def between_graphs_table(events: list[Kernel], graph_names: list[str]) -> str:
    """A markdown table of ``between_graphs``, per gap."""
    result = between_graphs(events, graph_names)
    count = len(result.gaps_us)
    if not count:
        return "between graphs: fewer than two replays found in the trace"
    lines = [f"between graphs: {sum(result.gaps_us) / count:.1f} us a step (min {min(result.gaps_us):.1f}, "
             f"max {max(result.gaps_us):.1f}, {count} gaps)",
             "| operation (after) | calls/step | critical us/step | idle us/step | duration us/call |",
             "|---|---:|---:|---:|---:|"]
    for name, s in sorted(result.shares.items(), key=lambda kv: -(kv[1].critical_us + kv[1].idle_us)):
        lines.append(f"| {name} | {s.calls / count:.3g} | {s.critical_us / count:.1f} | {s.idle_us / count:.1f} "
                     f"| {s.duration_us / s.calls:.2f} |")
    return "\n".join(lines)
