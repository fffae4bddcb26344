"""NVLink multicast stays off: ``keep_multicast_off`` sets NCCL_NVLS_ENABLE=0 and
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 where absent and keeps a value already set. That every process a
``kiln serve`` starts has them (HTTP, scheduler, detokenizer, ranks, another node's) is checked on
real processes in ``test_nodes.py``."""

from __future__ import annotations

import os

from kiln.runtime.worker.nccl_env import MULTICAST_OFF, keep_multicast_off


def test_absent_values_are_set(monkeypatch):
    for name in MULTICAST_OFF:
        monkeypatch.delenv(name, raising=False)
    keep_multicast_off()
    assert {name: os.environ[name] for name in MULTICAST_OFF} == \
        {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def test_values_already_set_are_kept(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "yes")
    keep_multicast_off()
    assert os.environ["NCCL_NVLS_ENABLE"] == "0" and os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "yes"
