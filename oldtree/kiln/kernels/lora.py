"""Batched multi-LoRA: the ``lora`` op (``kiln/ir/ops_lora.py``), each token row's adapter update.

``ref_lora`` is the plain-torch definition: every token row takes the slot of its tile in the step's
grouping (``lora_groups.py``; rows in no tile: the base model, no update), then ``h = x @ A[s].T``
(the shrink, f32) and, per slice ``i`` of y's columns, ``y[:, slice i] += h[:, i*R:(i+1)*R] @
B[s][slice i].T`` (the expand, f32, added to y once). It loops over the slots with masks rather than
over the sequences, so it never reads a device value on the host and can be captured. A
``prologue`` first makes the GEMM input from what x is (the unfused RMSNorm or SiLU·mul, as those
ops' references round). The Triton kernels are in ``lora_row_triton.py`` (a one-row step) and
``lora_tile_triton.py`` (tiles of the grouping: every other step).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from kiln.ir.types import TensorType

from .config import DEFAULTS, KernelConfig
from .elementwise import ref_silu_mul
from .lora_groups import grouped_slots
from .lora_row_triton import launch_row
from .lora_tile_triton import launch_tiles
from .lora_triton import PROLOGUE_CODES
from .norm import ref_rmsnorm
from .registry import register_impl
from .triton_support import IR_FLOATS, IR_INDEXES, require, require_device, require_index


def lora_input(x: torch.Tensor, norm_weight: torch.Tensor | None, prologue: str, eps: float) -> torch.Tensor:
    """The GEMM input the update multiplies: x, or the RMSNorm / SiLU·mul the prologue names, of x."""
    if prologue == "rmsnorm":
        return ref_rmsnorm(x, norm_weight, eps).to(x.dtype)
    if prologue == "silu_mul":
        return ref_silu_mul(*x.chunk(2, dim=-1))
    return x


def ref_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, lora_rows: torch.Tensor,
             lora_tiles: torch.Tensor, slices: Sequence[int], norm_weight: torch.Tensor | None = None,
             prologue: str = "none", eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(y plus each row's update, in y's dtype; the shrink h, zero on rows without an adapter)."""
    x = lora_input(x, norm_weight, prologue, eps)
    rank = lora_b.shape[2]
    slots = grouped_slots(lora_rows, lora_tiles, lora_a.shape[0])
    h = torch.zeros((x.shape[0], lora_a.shape[1]), dtype=torch.float32, device=x.device)
    delta = torch.zeros(y.shape, dtype=torch.float32, device=y.device)
    for s in range(lora_a.shape[0]):
        mask = (slots == s).to(torch.float32)[:, None]
        h_s = (x.float() @ lora_a[s].float().T) * mask
        h += h_s
        start = 0
        for i, width in enumerate(slices):
            delta[:, start:start + width] += h_s[:, i * rank:(i + 1) * rank] @ lora_b[s, start:start + width].float().T
            start += width
    return (y.float() + delta).to(y.dtype), h


def _torch_lora(y, x, lora_a, lora_b, lora_rows, lora_tiles, norm_weight=None, *, out, slices, prologue="none",
                eps=0.0):
    updated, h = ref_lora(y, x, lora_a, lora_b, lora_rows, lora_tiles, slices, norm_weight, prologue, eps)
    y.copy_(updated)
    out.copy_(h)
    return y


def triton_lora(y, x, lora_a, lora_b, lora_rows, lora_tiles, norm_weight=None, *, out, slices, prologue="none",
                eps=0.0, config: KernelConfig = DEFAULTS):
    """A step of one token row takes the one-row kernels (K split over the SMs), others the tiles of
    the step's grouping."""
    require_device("lora", y, x, lora_a, lora_b, lora_rows, lora_tiles, out)
    require_index("lora", "lora_rows", lora_rows, rank=2)
    require_index("lora", "lora_tiles", lora_tiles)
    require(all(t.is_contiguous() for t in (y, x, lora_a, lora_b, lora_rows, out)), "lora",
            lambda: "y, x, lora_a, lora_b, lora_rows and h must be contiguous")
    if x.shape[0] == 0:
        return y
    launch = launch_row if x.shape[0] == 1 else launch_tiles
    launch(y, x, lora_a, lora_b, lora_rows, lora_tiles, out, tuple(slices),
           norm_weight if norm_weight is not None else x, PROLOGUE_CODES[prologue], eps, config)
    return y


def _checker(types: Sequence[TensorType], attrs: Mapping[str, Any]) -> bool:
    y, x, lora_a, lora_b, *indexes = types[:6]
    return (y.dtype in IR_FLOATS and isinstance(lora_b.shape[2], int) and len(attrs["slices"]) <= 3
            and all(t.dtype in IR_INDEXES for t in indexes))


register_impl("lora", "torch", _torch_lora)
register_impl("lora", "triton", triton_lora, checker=_checker, priority=10, wants_config=True)
