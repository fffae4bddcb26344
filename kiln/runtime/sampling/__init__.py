"""Sampling: per-request parameters (``params``) and the batched sampler (``sampler``); its
counter-based random numbers and kernels live in ``kiln.kernels`` (``rng``, ``sample``, ``argmax``,
``bitmask``), the kernels reached through the registry (``SamplerKernels``)."""

from kiln.kernels.rng import child_seed, new_seed

from .params import SamplingParams
from .sampler import SamplerKernels, SamplerOutput, SamplingBatch, SamplingRow, masked_argmax, sample

__all__ = ["SamplingParams", "SamplingBatch", "SamplingRow", "SamplerKernels", "SamplerOutput", "sample",
           "masked_argmax", "new_seed", "child_seed"]
