"""bench/experiments/gemv_sweep.py: a variant is a KernelConfig with the GEMV taking every weight,
and a name that is no field is refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"
sys.path[:0] = [str(BENCH / "experiments"), str(BENCH)]
from gemv_sweep import parse_variant  # noqa: E402

from kiln.kernels.config import KernelConfigError  # noqa: E402


def test_variants_are_configs():
    config = parse_variant("gemv_block_n=(4,4) gemv_num_warps=8")
    assert config.changes() == {"gemv_block_n": (4, 4), "gemv_num_warps": 8, "gemv_max_weight_bytes": 1 << 62,
                                "gemv_one_row_max_weight_bytes": 1 << 62}
    assert parse_variant("").changes().keys() == {"gemv_max_weight_bytes", "gemv_one_row_max_weight_bytes"}
    with pytest.raises(KernelConfigError, match="no field 'GEMV_NUM_WARPS'"):
        parse_variant("GEMV_NUM_WARPS=8")
