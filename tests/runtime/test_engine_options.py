"""How unset engine options resolve: CUDA graphs by default on a GPU, not on a CPU, and never where a
kernel of the program reads device values on the host (capture forbids it)."""

from __future__ import annotations

import pytest
import torch

from kiln.runtime.engine_options import DEFAULT_DECODE_BUCKETS, EngineOptions, graph_settings


def test_graph_settings_follow_the_device_and_the_program():
    cpu, gpu, blockers = torch.device("cpu"), torch.device("cuda"), ["torch.rope_kv_attention"]
    assert graph_settings(EngineOptions(), cpu, []) == ((), False)  # a CPU runs steps eagerly by default
    assert graph_settings(EngineOptions(), gpu, []) == (DEFAULT_DECODE_BUCKETS, True)
    assert graph_settings(EngineOptions(), gpu, blockers) == ((), False)  # a kernel capture forbids: no graphs
    # Asked for on a CPU, the padded path runs eagerly (nothing is captured), so any kernel may run.
    assert graph_settings(EngineOptions(decode_buckets=[2, 1], prefill_graphs=True), cpu, blockers) == ((2, 1), True)
    for options in (EngineOptions(decode_buckets=(1,)), EngineOptions(prefill_graphs=True)):
        with pytest.raises(ValueError, match="copy device values to the host mid-step: torch.rope_kv_attention"):
            graph_settings(options, gpu, blockers)
