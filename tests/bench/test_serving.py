"""bench/serving.py: its figures (nearest-rank percentiles, workers merged from raw samples, the server's
histograms differenced and interpolated) on known samples, and whole runs against a real ``kiln serve``
of a tiny random model on loopback: both datasets and endpoints, and ``--workers 2`` with the server's
figures and the offline engine's beside the client's."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.harness import API_KEY, MODEL, ServerProcess, tiny_artifact

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
from serving_stats import (Result, WorkerRun, histogram_quantile, parse_metrics, percentiles,  # noqa: E402
                           server_figures, summarize)


def test_percentiles_are_nearest_rank_in_milliseconds():
    row = percentiles([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert row["p50"] == pytest.approx(50) and row["p90"] == pytest.approx(90) and row["p99"] == pytest.approx(99)
    assert row["mean"] == pytest.approx(50.5)
    assert percentiles([0.002])["p99"] == pytest.approx(2)
    assert percentiles([]) == {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}


def _result(start: float, ttft: float, e2e: float, tokens: int, ok: bool = True) -> Result:
    return Result(ok=ok, start=start, end=start + e2e, prompt_tokens=10, output_tokens=tokens, ttft=ttft,
                  itl=[(e2e - ttft) / (tokens - 1)] * (tokens - 1), error="" if ok else "HTTP 503: busy")


def test_workers_merge_raw_samples_not_their_percentiles():
    # Worker 0: nine fast requests; worker 1: one slow request and one failure.
    fast = WorkerRun(100.0, [_result(100.0 + i, 0.01, 1.0, 5) for i in range(9)])
    slow = WorkerRun(100.5, [_result(101.0, 1.0, 20.0, 3), _result(102.0, 0, 0, 0, ok=False)])
    report = summarize([fast, slow], {})
    assert report["workers"] == 2 and report["completed"] == 10 and report["failed"] == 1
    assert report["errors"] == ["HTTP 503: busy"]
    assert report["output_tokens"] == 9 * 5 + 3 and report["input_tokens"] == 100
    # From the first start (100.0) to the last end (101.0 + 20.0).
    assert report["duration_s"] == pytest.approx(21.0)
    assert report["output_throughput"] == pytest.approx(48 / 21.0)
    # Merged: 9 of 10 TTFTs are 10 ms, so p50 and p90 are 10 ms and p99 is the slow one; an average of
    # the workers' p50s would say 505 ms.
    assert report["ttft_ms"]["p50"] == pytest.approx(10) and report["ttft_ms"]["p90"] == pytest.approx(10)
    assert report["ttft_ms"]["p99"] == pytest.approx(1000)
    assert report["tpot_ms"]["p99"] == pytest.approx(1000 * 19.0 / 2)
    assert report["itl_ms"]["p50"] == pytest.approx(1000 * 0.99 / 4)
    assert [w["completed"] for w in report["per_worker"]] == [9, 1]
    assert [w["failed"] for w in report["per_worker"]] == [0, 1]


def test_a_request_without_text_completes_and_counts_its_tokens_but_no_latency():
    # Random weights emit ids the tokenizer has no piece for: such a stream finishes with no text.
    texts = WorkerRun(0.0, [_result(0.0, 0.01, 1.0, 5), Result(ok=True, start=0.0, end=2.0, output_tokens=7)])
    report = summarize([texts], {})
    assert report["completed"] == 2 and report["failed"] == 0 and report["output_tokens"] == 12
    assert report["ttft_ms"]["p99"] == pytest.approx(10) and report["tpot_ms"]["p99"] == pytest.approx(1000 * 0.99 / 4)
    assert report["e2e_ms"]["p99"] == pytest.approx(2000)


HISTOGRAM = """# HELP kiln_time_to_first_token_seconds Time from arrival to the first token
# TYPE kiln_time_to_first_token_seconds histogram
kiln_time_to_first_token_seconds_bucket{{le="0.1"}} {a}
kiln_time_to_first_token_seconds_bucket{{le="0.5"}} {b}
kiln_time_to_first_token_seconds_bucket{{le="+Inf"}} {c}
kiln_time_to_first_token_seconds_sum {s}
kiln_time_to_first_token_seconds_count {c}
kiln_generation_tokens_total {g}
kiln_requests_total{{endpoint="/v1/completions",status="200"}} 3
"""


def test_histogram_quantile_interpolates_inside_buckets():
    buckets = {"0.1": 10, "0.5": 30, "+Inf": 40}
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.1)   # the 10th of 40: the first bucket's top
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.3)    # the 20th: half way into (0.1, 0.5]
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.5)   # in +Inf: the last finite bound
    assert math.isnan(histogram_quantile(0.5, {"0.1": 0, "+Inf": 0}))


def test_server_figures_are_the_difference_of_two_scrapes():
    before = parse_metrics(HISTOGRAM.format(a=5, b=5, c=5, s=0.25, g=100))
    after = parse_metrics(HISTOGRAM.format(a=5, b=25, c=25, s=6.25, g=500))
    figures = server_figures(before, after, duration=2.0)
    assert figures["generation_tokens"] == 400 and figures["output_throughput"] == 200
    ttft = figures["ttft_ms"]
    assert ttft["count"] == 20 and ttft["mean"] == pytest.approx(300)
    assert ttft["p50"] == pytest.approx(300)  # 20 new observations, all in (0.1, 0.5]: the 10th is half way
    assert figures["e2e_ms"]["count"] == 0
    assert server_figures({}, parse_metrics("other_total 1\n"), 1.0) is None


@pytest.fixture(scope="module")
def tiny_server(smollm2_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_serve")
    with ServerProcess(tiny_artifact(smollm2_dir, root), root / "serve.log") as process:
        yield process


def bench(server: ServerProcess, out: Path, *extra: str) -> dict:
    done = subprocess.run([sys.executable, str(BENCH / "serving.py"), "--base-url", server.url, "--model", MODEL,
                           "--api-key", API_KEY, "--out", str(out), *extra], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TTFT client" in done.stdout and "req/s" in done.stdout
    return json.loads(out.read_text())


@pytest.mark.parametrize("dataset,endpoint,rate", [("random", "completions", "inf"), ("shared-prefix", "chat", "20")])
def test_serving_benchmark_reports(tiny_server, tmp_path, dataset, endpoint, rate):
    report = bench(tiny_server, tmp_path / "serving.json", "--dataset", dataset, "--endpoint", endpoint,
                   "--num-prompts", "6", "--input-len", "24", "--prefix-len", "64", "--num-groups", "2",
                   "--output-len", "4", "--ignore-eos", "--request-rate", rate, "--max-concurrency", "4")
    assert report["completed"] == 6 and report["failed"] == 0
    assert report["output_tokens"] == 24 and report["input_tokens"] >= 6 * 20
    assert report["request_throughput"] > 0 and report["output_throughput"] > 0
    for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        row = report[name]
        assert 0 < row["p50"] <= row["p90"] <= row["p99"]
    assert report["ttft_ms"]["p99"] <= report["e2e_ms"]["p99"]


def test_workers_server_figures_and_offline_in_one_run(tiny_server, tmp_path):
    report = bench(tiny_server, tmp_path / "serving.json", "--num-prompts", "10", "--input-len", "16",
                   "--output-len", "5", "--ignore-eos", "--max-concurrency", "6", "--workers", "2",
                   "--offline-shape", "smollm2-135m", "--offline-layers", "1")
    assert report["workers"] == 2 and report["completed"] == 10 and report["failed"] == 0
    assert [w["completed"] for w in report["per_worker"]] == [5, 5]
    assert sum(w["output_tokens"] for w in report["per_worker"]) == report["output_tokens"] == 50
    server = report["server"]  # nothing else ran on this server meanwhile: its counts are the run's
    assert server["generation_tokens"] == 50
    assert server["ttft_ms"]["count"] == 10 and server["e2e_ms"]["count"] == 10
    assert 0 < server["ttft_ms"]["p50"] <= server["ttft_ms"]["p99"]
    offline = report["offline"]
    assert offline["requests"] == 10 and offline["output_tokens"] == 50 and offline["prompt_tokens"] == 160
    assert offline["served_over_offline"] == pytest.approx(report["output_throughput"] / offline["output_tok_s"])


def test_outputs_constrained_to_a_json_schema(tiny_server, tmp_path):
    """``--json-schema``: every request carries the schema as its response_format, so the grammar ends
    each output (a constant string and the end of text) long before its max_tokens."""
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"const": "yes"}))
    report = bench(tiny_server, tmp_path / "serving.json", "--num-prompts", "4", "--input-len", "16",
                   "--output-len", "32", "--max-concurrency", "4", "--json-schema", str(schema))
    assert report["completed"] == 4 and report["failed"] == 0
    assert 4 <= report["output_tokens"] < 4 * 8


def test_an_unreadable_json_schema_is_refused(tmp_path):
    done = subprocess.run([sys.executable, str(BENCH / "serving.py"), "--model", MODEL, "--json-schema",
                           str(tmp_path / "missing.json")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "cannot read a JSON schema" in done.stderr
