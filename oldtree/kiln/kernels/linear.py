"""Dense GEMM: ``x @ weight.T (+ bias)``. The torch implementation is cuBLAS on the GPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .registry import register_impl


def ref_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 out: torch.Tensor) -> None:
    if bias is None:
        torch.matmul(x, weight.t(), out=out)
    else:
        torch.addmm(bias, x, weight.t(), out=out)


register_impl("linear", "torch", torch_linear)
