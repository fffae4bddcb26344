"""Elementwise kernels: add, mul, silu, silu_mul (the fused gate of a gated MLP), cast."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .registry import register_impl


def ref_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b


def ref_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a * b


def ref_silu(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x)


def ref_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def ref_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype)


def _add(a, b, *, out):
    torch.add(a, b, out=out)


def _mul(a, b, *, out):
    torch.mul(a, b, out=out)


def _silu(x, *, out):
    out.copy_(ref_silu(x))


def _silu_mul(gate, up, *, out):
    out.copy_(ref_silu_mul(gate, up))


def _cast(x, *, out, dtype):
    out.copy_(x)


register_impl("add", "torch", _add)
register_impl("mul", "torch", _mul)
register_impl("silu", "torch", _silu)
register_impl("silu_mul", "torch", _silu_mul)
register_impl("cast", "torch", _cast)
