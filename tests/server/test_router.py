"""The cache-aware router's decisions: longest prefix wins, new prefixes spread, load imbalance
sends to the least loaded replica, and every decision is counted in the metrics."""

from __future__ import annotations

from kiln.server.metrics import ServerMetrics
from kiln.server.router import CacheAwareRouter, RouterOptions

SYSTEM = list(range(1000, 1004))  # a short prefix every prompt shares (a chat template's)


def group(stem: int, question: int) -> list[int]:
    return SYSTEM + [stem] * 20 + [question, question + 1]


def test_each_shared_prefix_group_stays_on_one_replica():
    metrics = ServerMetrics(replicas=2)
    router = CacheAwareRouter(2, metrics)
    chosen = {(stem, q): router.route(group(stem, q)) for q in range(5) for stem in (1, 2)}
    # The first prompt of each group finds nothing worth reusing and goes where fewest tokens are held.
    assert {chosen[(1, q)] for q in range(5)} == {0} and {chosen[(2, q)] for q in range(5)} == {1}
    assert metrics.replica_requests.values == {("0",): 5, ("1",): 5}
    assert metrics.router_prompt_tokens.values[()] == 10 * 26
    # The first of each group matched the 4 shared ids elsewhere (or nothing); the others all but 2.
    assert metrics.router_hit_tokens.values[()] == 8 * 24
    assert 'kiln_router_prefix_hit_rate 0.7384615384615385' in metrics.render()


def test_load_imbalance_sends_to_the_least_loaded_replica():
    metrics = ServerMetrics(replicas=2)
    router = CacheAwareRouter(2, metrics, RouterOptions(balance_abs_threshold=2, balance_rel_threshold=1.5))
    assert [router.route(group(1, q)) for q in range(3)] == [0, 0, 0]  # loads 3 / 0: 3 - 0 > 2
    assert router.route(group(1, 9)) == 1
    assert metrics.replica_in_flight.values == {("0",): 3, ("1",): 1}
    for _ in range(3):
        router.finished(0)
    assert router.route(group(1, 10)) == 0  # balanced again: the prefix decides
    assert 'kiln_dp_requests_in_flight{replica="0"} 1' in metrics.render()


def test_one_replica_takes_everything_without_a_tree():
    metrics = ServerMetrics()
    router = CacheAwareRouter(1, metrics)
    assert router.route([1, 2, 3]) == 0 and router.tree.tokens == 0
    assert "kiln_dp_requests_total" not in metrics.render()
