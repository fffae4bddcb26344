"""Redundant expert placement (DeepSeek's EPLB, simplified): from measured tokens per expert, which
experts to replicate and how to lay the copies over the expert-parallel ranks so that each rank's
share of the routed tokens is as even as the slots allow.

A placement is, per sparse layer, the logical expert held in each physical slot, slot order being
rank order (slots ``r * S/ep ..`` on rank r). ``balance`` builds one in two greedy steps:
1. replicate: each of the ``redundant`` extra slots goes to the expert whose load per copy is then
   the highest (a copy takes an equal share of its expert's tokens);
2. pack: the copies, heaviest first, each to the rank with the least load that still has a free
   slot (longest-processing-time packing).

The ``place_experts`` pass (``passes/place_experts.py``) applies a placement: it stacks the experts'
weights in slot order and sends each token's choice of a replicated expert to one of its copies.
The loads come from kiln itself: ``kiln bench offline --out`` records ``expert_load`` per layer, and
``/metrics`` shows ``kiln_moe_expert_tokens_total``; ``kiln compile --expert-load FILE
--redundant-experts N`` turns them into ``CompileOptions.expert_placement``.
"""

from __future__ import annotations

import heapq
import json
from pathlib import Path
from typing import Mapping, Sequence

Placement = tuple[int, ...]  # the logical expert in each physical slot, rank by rank


def balance(loads: Sequence[int], redundant: int, ranks: int) -> Placement:
    experts = len(loads)
    slots = experts + redundant
    if redundant < 0 or ranks < 1 or slots % ranks:
        raise ValueError(f"{experts} experts + {redundant} redundant = {slots} slots do not split evenly over "
                         f"{ranks} expert-parallel rank(s)")
    copies = [1] * experts
    for _ in range(redundant):
        hottest = max(range(experts), key=lambda e: (loads[e] / copies[e], -e))
        copies[hottest] += 1
    items = sorted(((loads[e] / copies[e], e) for e in range(experts) for _ in range(copies[e])),
                   key=lambda item: (-item[0], item[1]))
    per_rank = slots // ranks
    held: list[list[int]] = [[] for _ in range(ranks)]
    heap = [(0.0, rank) for rank in range(ranks)]  # (load, rank) of ranks with a free slot
    for load, expert in items:
        total, rank = heapq.heappop(heap)
        held[rank].append(expert)
        if len(held[rank]) < per_rank:
            heapq.heappush(heap, (total + load, rank))
    return tuple(expert for rank in held for expert in sorted(rank))


def rank_loads(placement: Placement, loads: Sequence[int], ranks: int) -> list[float]:
    """Tokens each rank computes under ``placement``: a replicated expert's shared evenly by its copies."""
    copies = {e: placement.count(e) for e in set(placement)}
    per_rank = len(placement) // ranks
    return [sum(loads[e] / copies[e] for e in placement[r * per_rank:(r + 1) * per_rank]) for r in range(ranks)]


def placements_from_loads(loads: Mapping[int, Sequence[int]], redundant: int,
                          ranks: int) -> tuple[tuple[int, Placement], ...]:
    """``balance`` for every layer of measured loads, as ``CompileOptions.expert_placement``."""
    return tuple((layer, balance(counts, redundant, ranks)) for layer, counts in sorted(loads.items()))


def read_loads(path: Path) -> dict[int, list[int]]:
    """Tokens per expert by layer from a JSON file: ``{"layer": [count, ...]}`` (the ``expert_load`` that
    ``kiln bench offline --out`` records for each run)."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not all(isinstance(v, list) and all(isinstance(c, int) and c >= 0 for c in v)
                                             for v in data.values()):
        raise ValueError(f"{path}: expected a JSON object of layer -> list of token counts per expert")
    return {int(layer): counts for layer, counts in data.items()}
