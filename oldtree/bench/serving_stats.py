"""The figures of a serving benchmark: per-request samples, their percentiles, workers merged, and the
server's own figures read from its Prometheus ``/metrics``.

Each load process (``bench/serving.py --workers N``) returns its raw ``Result`` samples; ``summarize``
merges them before computing anything, so the percentiles are those of all requests together (never
an average of per-worker percentiles), and the duration runs from the first worker's start to the last
request's end (the clocks are one host's ``time.monotonic``, shared by its processes).

The server's side comes from two scrapes of ``/metrics``, before and after the load: counters and
histogram buckets are differenced, and a histogram's percentiles are interpolated inside its buckets
as Prometheus' ``histogram_quantile`` does (so they are as fine as the server's buckets).
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field

PERCENTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
# The server series reported beside the client's (kiln's names; other servers' are not read).
SERVER_COUNTERS = {"generation_tokens": "kiln_generation_tokens_total", "prompt_tokens": "kiln_prompt_tokens_total"}
SERVER_HISTOGRAMS = {"ttft_ms": "kiln_time_to_first_token_seconds", "itl_ms": "kiln_inter_token_latency_seconds",
                     "e2e_ms": "kiln_e2e_request_latency_seconds"}
_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{le="([^"]+)"\})? (\S+)$')


@dataclass
class Result:
    """One request as the client saw it; times are ``time.monotonic`` seconds."""

    ok: bool
    start: float = 0.0
    end: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None  # None: the stream carried no text
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def e2e(self) -> float:
        return self.end - self.start


@dataclass
class WorkerRun:
    """What one load process did: when it started sending and every request's result."""

    start: float
    results: list[Result]


def percentiles(values: list[float]) -> dict[str, float]:
    """Mean and nearest-rank p50/p90/p99 of ``values`` (seconds), in milliseconds."""
    if not values:
        return {"mean": 0.0, **{name: 0.0 for name in PERCENTILES}}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] * 1000

    return {"mean": statistics.fmean(ordered) * 1000, **{name: at(q) for name, q in PERCENTILES.items()}}


def summarize(runs: list[WorkerRun], config: dict) -> dict:
    """The merged report of every worker's requests."""
    results = [r for run in runs for r in run.results]
    done = [r for r in results if r.ok]
    start = min(run.start for run in runs)
    end = max([r.end for r in results if r.end] or [start])
    duration = max(end - start, 1e-9)
    output_tokens = sum(r.output_tokens for r in done)
    return {
        "config": config,
        "workers": len(runs),
        "duration_s": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "request_throughput": len(done) / duration,
        "input_tokens": sum(r.prompt_tokens for r in done),
        "output_tokens": output_tokens,
        "output_throughput": output_tokens / duration,
        "ttft_ms": percentiles([r.ttft for r in done if r.ttft is not None]),
        "itl_ms": percentiles([gap for r in done for gap in r.itl]),
        "tpot_ms": percentiles([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done
                               if r.output_tokens > 1 and r.ttft is not None]),
        "e2e_ms": percentiles([r.e2e for r in done]),
        "per_worker": [{"completed": sum(r.ok for r in run.results), "failed": sum(not r.ok for r in run.results),
                        "output_tokens": sum(r.output_tokens for r in run.results if r.ok)} for run in runs],
    }


def parse_metrics(text: str) -> dict[str, dict[str, float]]:
    """Prometheus text as {series name: {bucket bound or "": value}} (unlabelled series and ``le`` buckets;
    other labelled series are skipped)."""
    series: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            name, bound, value = match.groups()
            series.setdefault(name, {})[bound or ""] = float(value)
    return series


def histogram_quantile(q: float, buckets: dict[str, float]) -> float:
    """The ``q`` quantile of cumulative ``buckets`` ({upper bound: count}), interpolated linearly in the
    bucket holding it from the bucket's lower bound (0 for the first); the last finite bound if it
    falls in +Inf. NaN without observations."""
    bounds = sorted(((math.inf if b == "+Inf" else float(b)), count) for b, count in buckets.items())
    total = bounds[-1][1] if bounds else 0
    if total <= 0:
        return math.nan
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in bounds:
        if count >= rank:
            if math.isinf(bound):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return lower


def server_figures(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]],
                   duration: float) -> dict | None:
    """The server's figures over the run (differences of two scrapes); None when it has none of kiln's series."""
    if SERVER_COUNTERS["generation_tokens"] not in after:
        return None
    figures: dict = {}
    for key, name in SERVER_COUNTERS.items():
        figures[key] = after.get(name, {}).get("", 0.0) - before.get(name, {}).get("", 0.0)
    figures["output_throughput"] = figures["generation_tokens"] / max(duration, 1e-9)
    for key, name in SERVER_HISTOGRAMS.items():
        buckets = {b: c - before.get(f"{name}_bucket", {}).get(b, 0.0)
                   for b, c in after.get(f"{name}_bucket", {}).items()}
        count = after.get(f"{name}_count", {}).get("", 0.0) - before.get(f"{name}_count", {}).get("", 0.0)
        total = after.get(f"{name}_sum", {}).get("", 0.0) - before.get(f"{name}_sum", {}).get("", 0.0)
        figures[key] = {"count": count, "mean": 1000 * total / count if count else 0.0,
                        **{p: 1000 * histogram_quantile(q, buckets) if count else 0.0
                           for p, q in PERCENTILES.items()}}
    return figures
