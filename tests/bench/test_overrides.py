"""bench/overrides.py and the gemv_sweep variants built on it: a ``MODULE.NAME=VALUE`` setting
changes the constant kiln reads at launch, hands back the old value, and refuses unknown names."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from gemv_sweep import apply_variant  # noqa: E402
from overrides import set_constant  # noqa: E402

from kiln.kernels import attention_decode, gemv, linear_fused  # noqa: E402


def test_set_constant_returns_what_it_replaced(monkeypatch):
    monkeypatch.setattr(attention_decode, "MIN_SPLIT_TOKENS", attention_decode.MIN_SPLIT_TOKENS)
    before = attention_decode.MIN_SPLIT_TOKENS
    module, name, old = set_constant("kiln.kernels.attention_decode.MIN_SPLIT_TOKENS=7")
    assert (module, name, old) == (attention_decode, "MIN_SPLIT_TOKENS", before)
    assert attention_decode.MIN_SPLIT_TOKENS == 7


def test_set_constant_refuses_an_unknown_name():
    with pytest.raises(SystemExit, match="--set: kiln.kernels.gemv has no NO_SUCH_KNOB"):
        set_constant("kiln.kernels.gemv.NO_SUCH_KNOB=1")


def test_variant_names_are_gemv_or_another_kernels_module(monkeypatch):
    monkeypatch.setattr(gemv, "GEMV_BLOCK_K", gemv.GEMV_BLOCK_K)
    monkeypatch.setattr(linear_fused, "GEMV_MAX_WEIGHT_BYTES", linear_fused.GEMV_MAX_WEIGHT_BYTES)
    old = apply_variant("GEMV_BLOCK_K=(64,2048) linear_fused.GEMV_MAX_WEIGHT_BYTES=5")
    assert [(module, name) for module, name, _ in old] == [(gemv, "GEMV_BLOCK_K"),
                                                           (linear_fused, "GEMV_MAX_WEIGHT_BYTES")]
    assert gemv.GEMV_BLOCK_K == (64, 2048) and linear_fused.GEMV_MAX_WEIGHT_BYTES == 5
    with pytest.raises(SystemExit, match="--variant: kiln.kernels.gemv has no NOPE"):
        apply_variant("NOPE=1")
