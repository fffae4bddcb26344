"""bench/experiments/grammar_fill.py on the real SmolLM2 tokenizer: a row of the table for every grammar
position, with a time for one row and for each thread count both ways."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "experiments" / "grammar_fill.py"


def test_fill_times_by_position_and_threads(smollm2_dir):
    done = subprocess.run([sys.executable, str(SCRIPT), "--tokenizer-dir", str(smollm2_dir), "--rows", "4",
                           "--threads", "1", "2", "--repeats", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| position")]
    assert [row.split(" | ")[0][2:] for row in rows] == ["start", "in a string", "after a number",
                                                         "in an array's string"]
    assert all(len(row.strip("|").split("|")) == 6 for row in rows)  # position, one row, 2 x (batch, pool)
    report = json.loads(lines[-1])
    assert report["rows"] == 4 and report["threads"] == [1, 2] and report["cpus"] >= 1
