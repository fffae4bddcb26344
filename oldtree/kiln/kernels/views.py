"""View ops: reshape and split return views of their input and launch nothing."""

from __future__ import annotations

import torch

from .registry import register_impl


def ref_reshape(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return x.view(shape)


def ref_split(x: torch.Tensor, sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    return torch.split(x, list(sizes), dim=-1)


def _reshape(x, *, shape, sizes):
    return x.view(tuple(sizes[d] if isinstance(d, str) else d for d in shape))


register_impl("reshape", "torch", _reshape, wants_sizes=True)
register_impl("split", "torch", ref_split)
