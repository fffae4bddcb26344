"""Whole-row ops of draft heads and exposed hidden states: ``concat`` (rows side by side) and
``argmax`` (each row's best index, i32).

Single torch calls: neither reads device values on the host, so both run inside captured steps;
at draft-head sizes (a few rows of a few thousand columns) a Triton kernel would not beat them.
"""

from __future__ import annotations

import torch

from .registry import register_impl


def ref_concat(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None) -> torch.Tensor:
    return torch.cat([a, b] if c is None else [a, b, c], dim=1)


def ref_argmax(x: torch.Tensor) -> torch.Tensor:
    """The first maximum of each row (torch's rule: a NaN counts as the largest)."""
    return x.argmax(dim=-1).to(torch.int32)


def _concat(a, b, c=None, *, out):
    torch.cat([a, b] if c is None else [a, b, c], dim=1, out=out)


def _argmax(x, *, out):
    out.copy_(x.argmax(dim=-1))


register_impl("concat", "torch", _concat)
register_impl("argmax", "torch", _argmax)
