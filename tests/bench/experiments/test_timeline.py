"""bench/experiments/timeline.py: each kernel is charged what it adds to the end of the work before it, launch gaps
apart, so the shares add up to the span whatever the overlap."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "bench"
sys.path[:0] = [str(BENCH / "experiments"), str(BENCH)]
from timeline import Kernel, critical_path, critical_path_table  # noqa: E402


def test_sequential_kernels_with_a_launch_gap():
    shares = critical_path([Kernel("gemv", 20, 25), Kernel("gemv", 0, 10), Kernel("attn", 12, 20)])
    assert set(shares) == {"gemv (after start)", "attn (after gemv)", "gemv (after attn)"}
    assert shares["gemv (after start)"].critical_us == 10
    attn = shares["attn (after gemv)"]
    assert (attn.idle_us, attn.critical_us, attn.duration_us) == (2, 8, 8)
    assert shares["gemv (after attn)"].critical_us == 5
    assert sum(s.critical_us + s.idle_us for s in shares.values()) == 25


def test_an_early_launched_kernel_is_charged_past_the_previous_end_only():
    # Under PDL the next kernel starts at 5 and waits: 9 us long, 4 us on the critical path.
    shares = critical_path([Kernel("a", 0, 10), Kernel("b", 5, 14), Kernel("c", 6, 12)])
    b, c = shares["b (after a)"], shares["c (after b)"]
    assert (b.critical_us, b.duration_us, b.idle_us) == (4, 9, 0)
    assert c.critical_us == 0  # ends inside what is already running
    assert sum(s.critical_us + s.idle_us for s in shares.values()) == 14


def test_table_is_per_replay_and_names_are_cut():
    long_name = "nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT_with_a_long_tail"
    kernels = [Kernel(long_name, 0, 30), Kernel("gemv", 30, 40), Kernel(long_name, 40, 70), Kernel("gemv", 70, 80)]
    table = critical_path_table(kernels, steps=2, top=10).splitlines()
    assert table[0] == "critical path: 40.0 us per replay"
    first = table[3]
    assert first.startswith("| nvjet_sm90_tst_128x8_64x12_2x1_v_... (after start) |")
    # The first kernel of every later replay follows the last of the one before.
    assert "| 0.5 | 15.0 | 30.00 | 0.0 | 30.00 |" in first
    assert any(line.startswith("| gemv (after nvjet_sm90_tst_128x8_64x12_2x1_v_...) | 1 | 10.0 | 10.00 |")
               for line in table)
