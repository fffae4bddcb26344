"""Rotary embedding tables for every ``rope_type`` the supported models use.

A model's rope settings reduce at compile time to one f32 table ``[max_positions, rot]``: cos of
each position times each inverse frequency in the first half, sin in the second, both scaled by
the variant's attention factor (YaRN's mscale). The ``rope`` op reads it; nothing else about the
variant reaches the graph. Both config layouts are read: ``rope_theta`` + ``rope_scaling`` (the
checkpoints in the wild) and ``rope_parameters`` (what transformers 5 writes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rot_dim: int
    rope_type: str = "default"
    params: Mapping[str, Any] = field(default_factory=dict)

    @staticmethod
    def from_hf(config: Mapping[str, Any], head_dim: int) -> "RopeConfig":
        params = dict(config.get("rope_parameters") or {})
        legacy = config.get("rope_scaling") or {}
        params.update({k: v for k, v in legacy.items() if k not in params})
        theta = params.pop("rope_theta", None) or config.get("rope_theta") or 10000.0
        rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
        params.pop("type", None)
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        partial = params.pop("partial_rotary_factor", None) or config.get("partial_rotary_factor") or 1.0
        if rope_type in ("yarn", "llama3") and "original_max_position_embeddings" not in params:
            params["original_max_position_embeddings"] = config.get("original_max_position_embeddings") \
                or config["max_position_embeddings"]
        params["max_position_embeddings"] = config.get("max_position_embeddings")
        return RopeConfig(float(theta), int(head_dim * partial), rope_type, params)


def inverse_frequencies(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """The per-pair inverse frequencies (f32, ``[rot/2]``) and the attention factor."""
    dim = rope.rot_dim
    base = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    p = rope.params
    if rope.rope_type == "default":
        return base, 1.0
    if rope.rope_type == "linear":
        return base / p["factor"], 1.0
    if rope.rope_type == "llama3":
        return _llama3(base, p), 1.0
    return _yarn(rope, p)


def _llama3(inv_freq: torch.Tensor, p: Mapping[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, a smooth blend between.
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn(rope: RopeConfig, p: Mapping[str, Any]) -> tuple[torch.Tensor, float]:
    # YaRN: interpolate low frequencies, extrapolate high ones, blend with a linear ramp over the
    # dims between the beta_fast and beta_slow rotation counts; scale cos/sin by mscale.
    dim, base = rope.rot_dim, rope.theta
    factor = p.get("factor") or p["max_position_embeddings"] / p["original_max_position_embeddings"]
    original = p["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def cos_sin_table(rope: RopeConfig, max_positions: int) -> torch.Tensor:
    """``[max_positions, rot]`` f32: cos in the first half, sin in the second."""
    inv_freq, attention_factor = inverse_frequencies(rope)
    angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos() * attention_factor, angles.sin() * attention_factor], dim=1).contiguous()
