"""bench/experiments/graph_gaps.py: replays are found by their kernels' names in order, and the time between one
replay's end and the next one's start is charged to the operations queued there."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "bench"
sys.path[:0] = [str(BENCH / "experiments"), str(BENCH)]
from graph_gaps import NEXT, between_graphs, between_graphs_table, find_replays  # noqa: E402
from timeline import Kernel  # noqa: E402

GRAPH = ["embed", "gemv", "gemv"]


def _replay(at: float) -> list[Kernel]:
    return [Kernel("embed", at, at + 2), Kernel("gemv", at + 2, at + 10), Kernel("gemv", at + 9, at + 20)]


def test_replays_are_runs_of_the_graphs_kernel_names():
    events = [Kernel("gemv", -5, -1), *_replay(0), Kernel("copy", 21, 23), *_replay(30)]
    assert find_replays(events, GRAPH) == [(1, 4), (5, 8)]
    assert find_replays(events, ["nothing"]) == []


def test_operations_on_other_streams_inside_a_replay_are_skipped():
    # The next step's input copy runs on the copy stream while a replay's kernels run.
    events = [*_replay(0), Kernel("Memcpy HtoD", 25, 26), *_replay(30)]
    events.insert(2, Kernel("Memcpy HtoD", 3, 4))
    ordered = sorted(events, key=lambda e: e.start_us)
    assert find_replays(ordered, GRAPH) == [(0, 4), (5, 8)]
    result = between_graphs(events, GRAPH)
    assert result.gaps_us == [10] and result.shares["Memcpy HtoD (after (graph))"].calls == 1


def test_gap_is_charged_to_the_operations_between_replays_and_the_wait_after_them():
    events = [*_replay(0), Kernel("Memcpy DtoH", 21, 23), Kernel("Memcpy HtoD", 25, 26), Kernel("copy", 26, 28),
              *_replay(31), Kernel("Memcpy DtoH", 52, 54), *_replay(57)]
    result = between_graphs(events[::-1], GRAPH)  # any order
    assert result.gaps_us == [11, 6]
    dtoh = result.shares["Memcpy DtoH (after (graph))"]
    assert (dtoh.calls, dtoh.idle_us, dtoh.critical_us) == (2, 2, 4)
    htod = result.shares["Memcpy HtoD (after Memcpy DtoH)"]
    assert (htod.idle_us, htod.critical_us) == (2, 1)
    assert result.shares[f"{NEXT} (after copy)"].idle_us == 3
    assert result.shares[f"{NEXT} (after Memcpy DtoH)"].idle_us == 3
    assert sum(s.idle_us + s.critical_us for s in result.shares.values()) == 17
    assert not any(name.startswith("(graph)") for name in result.shares)


def test_table_reports_per_gap_and_says_when_nothing_was_found():
    events = [*_replay(0), Kernel("Memcpy HtoD", 22, 24), *_replay(30)]
    table = between_graphs_table(events, GRAPH).splitlines()
    assert table[0] == "between graphs: 10.0 us a step (min 10.0, max 10.0, 1 gaps)"
    assert "| Memcpy HtoD (after (graph)) | 1 | 2.0 | 2.0 | 2.00 |" in table
    assert between_graphs_table(_replay(0), GRAPH).startswith("between graphs: fewer than two replays")
