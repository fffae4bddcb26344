"""The data-parallel router: which engine replica (``kiln serve --dp N``) gets a prompt.

Cache-aware, as SGLang's router is: each replica's scheduler keeps its own radix prefix cache, so a
prompt is fastest where its longest prefix was sent before. The router approximates those caches
with one ``PrefixTree`` of the token ids it sent to each replica, balanced against load (requests
in flight per replica):

1. When the load is imbalanced -- the busiest replica has more than ``balance_abs_threshold``
   requests beyond the idlest and more than ``balance_rel_threshold`` times its count -- the
   least loaded replica gets the prompt, whatever it holds.
2. Otherwise the replica holding the longest prefix of the prompt gets it, if that prefix is more
   than ``cache_threshold`` of the prompt (ties: the less loaded replica).
3. Otherwise (nothing worth reusing) the least loaded replica, ties going to the one whose tree
   holds the fewest tokens, so new prefixes spread over the replicas.

The defaults are SGLang's router's. Every decision is counted in the server's metrics: requests per
replica, requests in flight per replica, and the prompt tokens the chosen replica was found to hold
(the router's prefix hit rate).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .metrics import ServerMetrics
from .prefix_tree import PrefixTree


@dataclass(frozen=True)
class RouterOptions:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_tokens: int = 1 << 22

    def validate(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1, got "
                             f"{self.balance_abs_threshold} and {self.balance_rel_threshold}")


class CacheAwareRouter:
    def __init__(self, replicas: int, metrics: ServerMetrics, options: RouterOptions = RouterOptions()) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {replicas}")
        options.validate()
        self.options = options
        self.metrics = metrics
        self.loads = [0] * replicas
        self.tree = PrefixTree(options.max_tree_tokens)

    def route(self, prompt_ids: Sequence[int]) -> int:
        """The replica for this prompt; counted in flight until ``finished``."""
        if len(self.loads) == 1:
            replica, held = 0, 0
        else:
            replica, held = self._choose(prompt_ids)
            self.tree.insert(prompt_ids, replica)
            self.metrics.router_prompt_tokens.inc(len(prompt_ids))
            self.metrics.router_hit_tokens.inc(held)
        self.loads[replica] += 1
        self.metrics.replica_requests.inc(replica=str(replica))
        self.metrics.replica_in_flight.set(self.loads[replica], replica=str(replica))
        return replica

    def finished(self, replica: int) -> None:
        self.loads[replica] -= 1
        self.metrics.replica_in_flight.set(self.loads[replica], replica=str(replica))

    def _choose(self, prompt_ids: Sequence[int]) -> tuple[int, int]:
        """(replica, prompt tokens it holds)."""
        matched = self.tree.match(prompt_ids)
        busiest, idlest = max(self.loads), min(self.loads)
        imbalanced = (busiest - idlest > self.options.balance_abs_threshold
                      and busiest > idlest * self.options.balance_rel_threshold)
        if not imbalanced and matched:
            best = max(matched, key=lambda r: (matched[r], -self.loads[r], -r))
            if matched[best] > self.options.cache_threshold * len(prompt_ids):
                return best, matched[best]
        replica = min(range(len(self.loads)), key=lambda r: (self.loads[r], self.tree.held.get(r, 0), r))
        return replica, matched.get(replica, 0)
