"""Server metrics in Prometheus' text exposition format (version 0.0.4), served at ``/metrics``.

The HTTP process counts what it sees (requests by endpoint and status, prompt and generated
tokens, time to first token, inter-token latency, end-to-end latency); the engine's gauges
(running and waiting requests, KV pool use, prefix-cache hits) come from each scheduler process's
latest published ``EngineCore.stats()``, with a MoE model's tokens per expert per layer
(``kiln_moe_expert_tokens_total{layer, expert}``). With several data-parallel replicas (``kiln serve --dp``)
the engine series are their sums (ratios recomputed from the sums), followed by each replica's
own with a ``replica`` label, and the router's series follow: requests routed to each replica,
requests in flight on each, and its prefix hit rate. The start-up phases' seconds end it
(``kiln_startup_seconds{phase, process}``, ``kiln.runtime.startup``). Everything runs on the event loop's thread,
so no locks. A few dozen lines here spare the server a dependency.

With several API servers (``kiln serve --api-server-count N``) each HTTP process counts its own
requests; a scrape of any one of them answers for the server: it asks the others for their series
(``snapshot``, over ``peers.py``) and renders the sums (counters, histograms, in-flight gauges),
followed by ``kiln_api_server_requests_total{api_server}``, the HTTP requests each one served.
The engine series are the schedulers' (every API server receives their stats), not summed.
"""

from __future__ import annotations

import bisect
import math
from typing import Any, Iterable, Mapping, Sequence

from kiln.runtime.outputs import EXPERT_TOKENS
from kiln.runtime.startup import StartupReport

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
                   40.0, 80.0)

# Engine gauges: (metric name, stats key, help, type).
ENGINE_SERIES = (
    ("kiln_num_requests_running", "running", "Samples being computed (prefill or decode)", "gauge"),
    ("kiln_num_requests_waiting", "waiting", "Samples queued for admission", "gauge"),
    ("kiln_kv_cache_usage_ratio", "kv_usage", "Fraction of KV pages not on the free list (includes cached ones)",
     "gauge"),
    ("kiln_kv_pages_total", "kv_pages_total", "KV pages in the pool", "gauge"),
    ("kiln_kv_pages_free", "kv_pages_free", "KV pages on the free list", "gauge"),
    ("kiln_kv_pages_cached", "kv_pages_cached", "KV pages held by the radix prefix cache", "gauge"),
    ("kiln_kv_pages_available", "kv_pages_available", "KV pages free or evictable from the prefix cache", "gauge"),
    ("kiln_kv_pages_held", "kv_pages_held", "KV pages pinned by running requests (0 when idle)", "gauge"),
    ("kiln_radix_locked_nodes", "radix_locked_nodes", "Prefix-cache nodes locked by running requests (0 when idle)",
     "gauge"),
    ("kiln_prefix_cache_hit_rate", "cache_hit_rate", "Prompt tokens found in the prefix cache / tokens looked up",
     "gauge"),
    ("kiln_prefix_cache_hit_tokens_total", "cache_hit_tokens", "Prompt tokens found in the prefix cache", "counter"),
    ("kiln_prefix_cache_queried_tokens_total", "cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
     "counter"),
    ("kiln_retractions_total", "retractions", "Requests retracted to free KV", "counter"),
    # Speculative decoding (only when it is on; see runtime/spec/speculator.py).
    ("kiln_spec_accept_length", "spec_accept_length",
     "Tokens per request of the last verify step (accepted drafts + the target's own token)", "gauge"),
    ("kiln_spec_mean_accept_length", "spec_mean_accept_length", "Tokens per request per verify step, since start",
     "gauge"),
    ("kiln_spec_verify_steps_total", "spec_verify_steps", "Request-steps that verified drafts", "counter"),
    ("kiln_spec_verify_tokens_total", "spec_verify_tokens", "Tokens verify steps produced", "counter"),
    ("kiln_spec_drafted_tokens_total", "spec_drafted_tokens", "Draft tokens verified", "counter"),
    ("kiln_spec_accepted_drafts_total", "spec_accepted_drafts", "Draft tokens the target accepted", "counter"),
)
# Engine stats that are ratios: (numerator, denominator) keys, so that replicas combine by their sums.
RATIO_STATS = {"kv_usage": ("kv_pages_used", "kv_pages_total"),
               "cache_hit_rate": ("cache_hit_tokens", "cache_queried_tokens")}


def combine_stats(replicas: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Several replicas' ``EngineCore.stats()`` as one engine's: sums, and ratios of the sums."""
    combined: dict[str, float] = {}
    for stats in replicas:
        for key, value in stats.items():
            if key not in RATIO_STATS:
                combined[key] = combined.get(key, 0) + value
    for key, (numerator, denominator) in RATIO_STATS.items():
        if denominator in combined:
            combined[key] = combined[numerator] / combined[denominator] if combined[denominator] else 0.0
    return combined


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if isinstance(value, float) else str(value)


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    text = ",".join(f'{k}="{_escape(v)}"' for k, v in pairs)
    return "{" + text + "}" if text else ""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _expert_lines(stats: Mapping[str, float]) -> list[str]:
    """A MoE model's tokens per expert per layer (``EngineCore.expert_load_stats``), labelled."""
    loads = sorted((tuple(int(part) for part in key[len(EXPERT_TOKENS):].split(":")), value)
                   for key, value in stats.items() if key.startswith(EXPERT_TOKENS))
    if not loads:
        return []
    return ["# HELP kiln_moe_expert_tokens_total Tokens the router sent to each expert of each sparse layer "
            "(a token counts once for each expert it chose)", "# TYPE kiln_moe_expert_tokens_total counter",
            *(f'kiln_moe_expert_tokens_total{{layer="{layer}",expert="{expert}"}} {_number(value)}'
              for (layer, expert), value in loads)]


class Counter:
    def __init__(self, name: str, help_text: str, labels: tuple[str, ...] = ()) -> None:
        self.name, self.help, self.label_names = name, help_text, labels
        self.values: dict[tuple[str, ...], float] = {} if labels else {(): 0}

    def inc(self, amount: float = 1, **labels: str) -> None:
        key = tuple(str(labels[n]) for n in self.label_names)
        self.values[key] = self.values.get(key, 0) + amount

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        for key, value in sorted(self.values.items()):
            lines.append(f"{self.name}{_labels(zip(self.label_names, key))} {_number(value)}")
        return lines

    def state(self) -> list[list[Any]]:
        """The values as plain data (msgpack), for ``absorb`` in another process."""
        return [[list(key), value] for key, value in self.values.items()]

    def absorb(self, state: list[list[Any]]) -> None:
        """Adds another process's ``state`` of this series to this one."""
        for key, value in state:
            self.values[tuple(key)] = self.values.get(tuple(key), 0) + value


class Gauge(Counter):
    def set(self, value: float, **labels: str) -> None:
        self.values[tuple(str(labels[n]) for n in self.label_names)] = value

    def render(self) -> list[str]:
        lines = super().render()
        lines[1] = f"# TYPE {self.name} gauge"
        return lines


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.name, self.help, self.bounds = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, count in zip((*self.bounds, math.inf), self.counts):
            running += count
            lines.append(f'{self.name}_bucket{{le="{_number(bound)}"}} {running}')
        lines += [f"{self.name}_sum {_number(self.sum)}", f"{self.name}_count {self.count}"]
        return lines

    def state(self) -> list[Any]:
        return [self.counts, self.sum, self.count]

    def absorb(self, state: list[Any]) -> None:
        counts, total, count = state
        self.counts = [mine + theirs for mine, theirs in zip(self.counts, counts)]
        self.sum += total
        self.count += count


class ServerMetrics:
    def __init__(self, replicas: int = 1, api_server: int = 0) -> None:
        """``api_server``: the index of the HTTP process counting these (``--api-server-count``)."""
        self.replicas = replicas
        self.api_server = api_server
        self.requests = Counter("kiln_requests_total", "HTTP requests by endpoint and status", ("endpoint", "status"))
        self.prompt_tokens = Counter("kiln_prompt_tokens_total", "Prompt tokens of finished requests")
        self.generation_tokens = Counter("kiln_generation_tokens_total", "Tokens generated")
        self.ttft = Histogram("kiln_time_to_first_token_seconds", "Time from arrival to the first token")
        self.itl = Histogram("kiln_inter_token_latency_seconds", "Time between a sample's successive tokens")
        self.e2e = Histogram("kiln_e2e_request_latency_seconds", "Time from arrival to the last token")
        self.queue_rejections = Counter("kiln_queue_rejections_total",
                                        "Requests refused with 503 because the queue was full (--max-queued-requests)")
        self.replica_stats: dict[int, Mapping[str, float]] = {}  # the latest EngineCore.stats() of each replica
        self.replica_requests = Counter("kiln_dp_requests_total", "Requests routed to each data-parallel replica",
                                        ("replica",))
        self.replica_in_flight = Gauge("kiln_dp_requests_in_flight", "Requests in flight on each replica",
                                       ("replica",))
        self.router_prompt_tokens = Counter("kiln_router_prompt_tokens_total", "Prompt tokens the router routed")
        self.router_hit_tokens = Counter("kiln_router_prefix_hit_tokens_total",
                                         "Prompt tokens whose prefix the router had sent to the chosen replica")
        self.startup: StartupReport | None = None  # set once the server listens (http_process.py)

    @property
    def engine_stats(self) -> Mapping[str, float]:
        return combine_stats(self.replica_stats.values())

    def _own_series(self) -> tuple[Counter | Histogram, ...]:
        """What this HTTP process counts itself (the rest are the schedulers' stats)."""
        return (self.requests, self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e,
                self.queue_rejections, self.replica_requests, self.replica_in_flight, self.router_prompt_tokens,
                self.router_hit_tokens)

    def snapshot(self) -> dict[str, Any]:
        """This process's own series as plain data, for another API server's ``render``."""
        return {"api_server": self.api_server, "series": {m.name: m.state() for m in self._own_series()}}

    def render(self, others: Sequence[Mapping[str, Any]] = ()) -> str:
        """The exposition text; ``others``: the other API servers' ``snapshot``s, added to this one's."""
        if not others:
            return self._render()
        merged = ServerMetrics(self.replicas, self.api_server)
        merged.replica_stats = self.replica_stats
        merged.startup = self.startup  # the server's report (API server 0 made it and told the others)
        snapshots = sorted([self.snapshot(), *others], key=lambda s: s["api_server"])
        for snapshot in snapshots:
            for metric in merged._own_series():
                metric.absorb(snapshot["series"][metric.name])
        per_server = Counter("kiln_api_server_requests_total", "HTTP requests each API server process answered "
                             "(--api-server-count)", ("api_server",))
        for snapshot in snapshots:
            per_server.inc(sum(value for _, value in snapshot["series"][self.requests.name]),
                           api_server=str(snapshot["api_server"]))
        return merged._render() + "\n".join(per_server.render()) + "\n"

    def _render(self) -> str:
        lines: list[str] = []
        for metric in (self.requests, self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e,
                       self.queue_rejections):
            lines += metric.render()
        combined = self.engine_stats
        per_replica = sorted(self.replica_stats.items()) if self.replicas > 1 else []
        for name, key, help_text, kind in ENGINE_SERIES:
            if key in combined:
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {_number(combined[key])}"]
                lines += [f'{name}{{replica="{replica}"}} {_number(stats[key])}' for replica, stats in per_replica]
        lines += _expert_lines(combined)
        if self.replicas > 1:
            lines += self._router_lines()
        if self.startup is not None:
            lines += self.startup.metric_lines()
        return "\n".join(lines) + "\n"

    def _router_lines(self) -> list[str]:
        routed, hits = self.router_prompt_tokens.values[()], self.router_hit_tokens.values[()]
        lines = []
        for metric in (self.replica_requests, self.replica_in_flight, self.router_prompt_tokens,
                       self.router_hit_tokens):
            lines += metric.render()
        return lines + ["# HELP kiln_router_prefix_hit_rate Prompt tokens found in the chosen replica's prefixes / "
                        "tokens routed", "# TYPE kiln_router_prefix_hit_rate gauge",
                        f"kiln_router_prefix_hit_rate {_number(hits / routed if routed else 0.0)}"]
