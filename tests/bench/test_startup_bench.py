"""bench/startup.py: a real ``kiln serve`` of a tiny random model started, timed to ``/health`` and
stopped, its phases printed and written as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.server.harness import tiny_artifact

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_startup_bench_times_health_and_prints_the_phases(smollm2_dir, tmp_path):
    artifact = tiny_artifact(smollm2_dir, tmp_path)
    out = tmp_path / "startup.json"
    done = subprocess.run([sys.executable, str(BENCH / "startup.py"), "--artifact", str(artifact), "--runs", "1",
                           "--out", str(out), "--", "--device", "cpu", "--kv-cache-tokens", "4096"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "run 1: /health after" in done.stdout and "/health after: best" in done.stdout
    assert "scheduler    weights_load" in done.stdout
    run, = json.loads(out.read_text())["runs"]
    assert run["health_seconds"] > 0 and run["startup"]["seconds"] > 0
    assert {"spawn", "imports", "weights_load"} <= {p["name"] for p in run["startup"]["phases"]}
