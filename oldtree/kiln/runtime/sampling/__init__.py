"""Sampling: per-request parameters (``params``) and the batched sampler (``sampler``); its
counter-based random numbers and kernels live in ``kiln.kernels`` (``rng``, ``sample``, ``argmax``,
``bitmask``), the kernels reached through the registry (``SamplerKernels``).

``SamplingParams`` is plain Python; the sampler's names are imported on first use, so that the
server's HTTP and detokenizer processes, which only read parameters, never import torch (it would
cost them a second or more of start-up).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .params import SamplingParams

if TYPE_CHECKING:
    from kiln.kernels.rng import child_seed, new_seed

    from .sampler import SamplerKernels, SamplerOutput, SamplingBatch, SamplingRow, masked_argmax, sample

__all__ = ["SamplingParams", "SamplingBatch", "SamplingRow", "SamplerKernels", "SamplerOutput", "sample",
           "masked_argmax", "new_seed", "child_seed"]

_FROM_RNG = ("child_seed", "new_seed")


def __getattr__(name: str) -> Any:
    if name in _FROM_RNG:
        from kiln.kernels import rng

        return getattr(rng, name)
    if name in __all__:
        from . import sampler

        return getattr(sampler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
