"""Which devices each data-parallel replica's scheduler runs on (``replica_options``)."""

from __future__ import annotations

import pytest
import torch

from kiln.runtime.engine_options import EngineOptions
from kiln.server.scheduler_process import replica_options


def test_cpu_replicas_share_the_host():
    options = EngineOptions(device="cpu", world_size=2)
    assert replica_options(options, 0) is options and replica_options(options, 3) is options


@pytest.mark.skipif(torch.cuda.device_count() >= 4, reason="checks the error on a host with fewer GPUs")
def test_a_replica_beyond_the_gpus_is_refused_naming_the_device():
    with pytest.raises(ValueError, match=r"replica 1 of 2 rank\(s\) needs cuda:5, and this host has \d+ GPUs; "
                                         r"lower --dp"):
        replica_options(EngineOptions(device="cuda:2", world_size=2), 1)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_replicas_take_their_own_devices():
    assert replica_options(EngineOptions(device="cuda"), 1).device == "cuda:1"
