"""bench/serving.py against the shared server: both datasets and endpoints run, and the JSON report
holds throughput and latency percentiles that add up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.harness import API_KEY, MODEL

BENCH = Path(__file__).resolve().parents[2] / "bench" / "serving.py"


@pytest.mark.parametrize("dataset,endpoint,rate", [("random", "completions", "inf"), ("shared-prefix", "chat", "20")])
def test_serving_benchmark_reports(server, tmp_path, dataset, endpoint, rate):
    out = tmp_path / "serving.json"
    done = subprocess.run([sys.executable, str(BENCH), "--base-url", server.url, "--model", MODEL, "--api-key", API_KEY,
                           "--dataset", dataset, "--endpoint", endpoint, "--num-prompts", "6", "--input-len", "24",
                           "--prefix-len", "64", "--num-groups", "2", "--output-len", "4", "--ignore-eos",
                           "--request-rate", rate, "--max-concurrency", "4", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TTFT" in done.stdout and "req/s" in done.stdout
    report = json.loads(out.read_text())
    assert report["completed"] == 6 and report["failed"] == 0
    assert report["output_tokens"] == 24 and report["input_tokens"] >= 6 * 20
    assert report["request_throughput"] > 0 and report["output_throughput"] > 0
    for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        row = report[name]
        assert 0 < row["p50"] <= row["p90"] <= row["p99"]
    assert report["ttft_ms"]["p99"] <= report["e2e_ms"]["p99"]
