"""Sampling: per-request parameters (``params``), the batched sampler (``sampler``) and its
counter-based random numbers (``rng``)."""

from .params import SamplingParams
from kiln.kernels.rng import child_seed, new_seed
from .sampler import SamplerOutput, SamplingBatch, SamplingRow, masked_argmax, sample

__all__ = ["SamplingParams", "SamplingBatch", "SamplingRow", "SamplerOutput", "sample", "masked_argmax", "new_seed", "child_seed"]
