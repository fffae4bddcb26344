"""The expert counters the model runner keeps: zeros per sparse layer from the manifest's list,
read back by decoder layer, and ``counted_once`` restoring them after a graph capture's warm-up runs
(which compute a real step twice more), leaving the KV views alone."""

from __future__ import annotations

import torch

from kiln.runtime.worker.expert_load import ExpertLoad, counted_once


def test_counters_start_at_zero_and_read_by_layer():
    load = ExpertLoad([{"input": "expert_load.1", "layer": 1, "experts": 4},
                       {"input": "expert_load.3", "layer": 3, "experts": 4}], torch.device("cpu"))
    views = load.views()
    views["expert_load.3"][2] += 5
    assert load.read() == {1: [0, 0, 0, 0], 3: [0, 0, 5, 0]}
    assert ExpertLoad([], torch.device("cpu")).read() == {}


def test_counted_once_restores_the_counters_only():
    load = ExpertLoad([{"input": "expert_load.0", "layer": 0, "experts": 3}], torch.device("cpu"))
    views = {"k_cache.0": torch.zeros(2), **load.views()}
    views["expert_load.0"] += 1
    with counted_once(views):
        views["expert_load.0"] += 7  # the warm-up runs
        views["k_cache.0"] += 1      # their KV writes stay (the replay rewrites the same values)
    assert load.read() == {0: [1, 1, 1]} and views["k_cache.0"].tolist() == [1.0, 1.0]
