"""bench/disagg.py on the CPU at a tiny shape: the mixed server and the disaggregated layout (prefill
server, decode server, router) each answer every request of the same workload, and the comparison
table and JSON carry TTFT and TPOT percentiles of both."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.server.harness import tiny_artifact

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_mixed_and_disaggregated_layouts_answer_the_same_workload(smollm2_dir, tmp_path):
    artifact = tiny_artifact(smollm2_dir, tmp_path, max_seq_len=256)
    out = tmp_path / "disagg.json"
    done = subprocess.run([sys.executable, str(BENCH / "disagg.py"), str(artifact), "--device", "cpu",
                           "--serve-args", "--kv-cache-tokens 4096", "--out", str(out), "--num-prompts", "6",
                           "--input-len", "96", "--output-len", "8", "--ignore-eos", "--max-concurrency", "3"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert set(results) == {"mixed", "disaggregated"}
    for summary in results.values():
        assert summary["completed"] == 6 and summary["failed"] == 0, (summary["errors"], server_logs(tmp_path))
        assert summary["ttft_ms"]["p50"] > 0 and summary["tpot_ms"]["p50"] > 0
    assert "TTFT p50" in done.stdout and "disaggregated" in done.stdout


def server_logs(logs: Path) -> str:
    """The servers' and the router's log tails (bench/disagg.py writes them beside ``--out``)."""
    return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}" for log in sorted(logs.glob("*.log")))
