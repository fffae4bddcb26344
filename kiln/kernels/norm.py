"""RMSNorm kernels: plain and fused with the residual add before it."""

from __future__ import annotations

import torch

from .registry import register_impl


def ref_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As HF's LlamaRMSNorm: normalize in f32, cast back, then scale in the input's dtype.
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def ref_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return ref_rmsnorm(summed, weight, eps), summed


def _rmsnorm(x, weight, *, out, eps):
    out.copy_(ref_rmsnorm(x, weight, eps))


def _add_rmsnorm(x, residual, weight, *, out, eps):
    normed, summed = ref_add_rmsnorm(x, residual, weight, eps)
    out[0].copy_(normed)
    out[1].copy_(summed)


register_impl("rmsnorm", "torch", _rmsnorm)
register_impl("add_rmsnorm", "torch", _add_rmsnorm)
