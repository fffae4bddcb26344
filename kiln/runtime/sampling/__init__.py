"""Sampling: per-request parameters (``params``) and the batched sampler (``sampler``); its
counter-based random numbers and kernels live in ``kiln.kernels`` (``rng``, ``sample``, ``argmax``)."""

from kiln.kernels.rng import child_seed, new_seed

from .params import SamplingParams
from .sampler import SamplerOutput, SamplingBatch, SamplingRow, masked_argmax, sample

__all__ = ["SamplingParams", "SamplingBatch", "SamplingRow", "SamplerOutput", "sample", "masked_argmax", "new_seed",
           "child_seed"]
