"""/metrics rendering: replicas' engine stats combine into one engine's (sums; ratios of the sums)
and, with several replicas, each one's series follow with a ``replica`` label."""

from __future__ import annotations

from kiln.server.metrics import ServerMetrics, combine_stats

REPLICA_0 = {"running": 2, "kv_pages_total": 100, "kv_pages_used": 30, "kv_usage": 0.3, "cache_hit_tokens": 10,
             "cache_queried_tokens": 40, "cache_hit_rate": 0.25}
REPLICA_1 = {"running": 1, "kv_pages_total": 100, "kv_pages_used": 10, "kv_usage": 0.1, "cache_hit_tokens": 30,
             "cache_queried_tokens": 40, "cache_hit_rate": 0.75}


def test_replicas_combine_by_sums_and_ratios_of_sums():
    combined = combine_stats([REPLICA_0, REPLICA_1])
    assert combined == {"running": 3, "kv_pages_total": 200, "kv_pages_used": 40, "kv_usage": 0.2,
                        "cache_hit_tokens": 40, "cache_queried_tokens": 80, "cache_hit_rate": 0.5}
    assert combine_stats([REPLICA_0]) == REPLICA_0


def test_each_replica_has_its_labelled_series_beside_the_sum():
    metrics = ServerMetrics(replicas=2)
    metrics.replica_stats.update({0: REPLICA_0, 1: REPLICA_1})
    lines = metrics.render().splitlines()
    assert lines.index("kiln_num_requests_running 3") + 2 == lines.index('kiln_num_requests_running{replica="1"} 1')
    assert "kiln_prefix_cache_hit_rate 0.5" in lines and 'kiln_prefix_cache_hit_rate{replica="0"} 0.25' in lines
    assert "kiln_router_prefix_hit_rate 0.0" in lines


def test_one_replica_renders_as_before():
    metrics = ServerMetrics()
    metrics.replica_stats[0] = REPLICA_0
    text = metrics.render()
    assert "kiln_num_requests_running 2\n" in text and "replica=" not in text and "kiln_router" not in text


def test_expert_tokens_render_by_layer_and_expert_and_replicas_sum():
    metrics = ServerMetrics(replicas=2)
    metrics.replica_stats.update({0: {"expert_tokens:3:0": 5, "expert_tokens:3:1": 2, "expert_tokens:10:0": 1},
                                  1: {"expert_tokens:3:0": 1, "expert_tokens:3:1": 0, "expert_tokens:10:0": 4}})
    lines = [line for line in metrics.render().splitlines() if "kiln_moe_expert_tokens_total" in line]
    assert lines[1] == "# TYPE kiln_moe_expert_tokens_total counter"
    assert lines[2:] == ['kiln_moe_expert_tokens_total{layer="3",expert="0"} 6',
                         'kiln_moe_expert_tokens_total{layer="3",expert="1"} 2',
                         'kiln_moe_expert_tokens_total{layer="10",expert="0"} 5']
    assert "kiln_moe_expert_tokens_total" not in ServerMetrics().render()  # a dense model has none


def test_other_api_servers_series_add_to_this_ones_through_msgpack():
    from kiln.server import ipc

    mine, theirs = ServerMetrics(api_server=0), ServerMetrics(api_server=1)
    for metrics, requests, ttft in ((mine, 3, 0.003), (theirs, 2, 0.5)):
        metrics.replica_stats[0] = REPLICA_0  # the scheduler's stats reach every API server alike
        metrics.requests.inc(requests, endpoint="/v1/completions", status="200")
        metrics.generation_tokens.inc(10 * requests)
        metrics.ttft.observe(ttft)
    theirs.requests.inc(endpoint="/metrics", status="200")
    snapshot = ipc.unpack(ipc.pack(["answer", theirs.snapshot()]))[1]  # as it crosses processes
    lines = mine.render([snapshot]).splitlines()
    assert 'kiln_requests_total{endpoint="/v1/completions",status="200"} 5' in lines
    assert 'kiln_requests_total{endpoint="/metrics",status="200"} 1' in lines
    assert "kiln_generation_tokens_total 50" in lines
    assert "kiln_time_to_first_token_seconds_count 2" in lines
    assert 'kiln_time_to_first_token_seconds_bucket{le="0.005"} 1' in lines
    assert 'kiln_time_to_first_token_seconds_bucket{le="0.5"} 2' in lines
    assert "kiln_num_requests_running 2" in lines  # not summed: one scheduler
    assert lines[-2:] == ['kiln_api_server_requests_total{api_server="0"} 3',
                          'kiln_api_server_requests_total{api_server="1"} 3']
    assert "kiln_api_server_requests_total" not in mine.render()  # alone, as before
