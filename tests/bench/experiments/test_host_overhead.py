"""bench/experiments/host_overhead.py runs its engine on the CPU through the overlapped decode chain it measures."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[3] / "bench"
sys.path[:0] = [str(BENCH / "experiments"), str(BENCH)]
from host_overhead import host_ms_per_step  # noqa: E402
from models import random_model  # noqa: E402


def test_host_share_of_a_few_overlapped_steps(tmp_path):
    _, source = random_model("smollm2-135m", dtype=torch.float32, layers=1, device="cpu", vocab_size=512)
    assert host_ms_per_step(source, batch=3, steps=2, directory=tmp_path) > 0
