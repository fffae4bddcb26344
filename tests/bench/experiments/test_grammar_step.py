"""bench/experiments/grammar_step.py on the real SmolLM2 tokenizer: a row of the table for each row count
and grammar position, a step time for each thread cap."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "experiments" / "grammar_step.py"


def test_step_times_by_rows_position_and_threads(smollm2_dir):
    done = subprocess.run([sys.executable, str(SCRIPT), "--tokenizer-dir", str(smollm2_dir), "--rows", "4", "20",
                           "--threads", "1", "2", "--repeats", "2", "--python-us", "10"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| rows")]
    assert [tuple(cell.strip() for cell in row.strip("|").split("|")[:2]) for row in rows] == [
        ("4", "mixed positions"), ("4", "in a string"), ("20", "mixed positions"), ("20", "in a string")]
    report = json.loads(lines[-1])
    assert report["threads"] == [1, 2] and all(len(cells) == 2 and min(cells) > 0
                                               for cells in report["steps_us"].values())
