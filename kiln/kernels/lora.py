"""Batched multi-LoRA: the ``lora_shrink`` and ``lora_expand`` ops (``kiln/ir/ops_lora.py``), each token
row's adapter update in two steps.

``ref_lora_shrink`` and ``ref_lora_expand`` are the plain-torch definitions: every token row takes the
slot of its tile in the step's grouping (``lora_groups.py``; rows in no tile: the base model, no
update), then ``h = x @ A[s].T`` (the shrink, f32) and, per slice ``i`` of y's columns, ``y[:, slice
i] += h[:, i*R:(i+1)*R] @ B[s][slice i].T`` (the expand, f32, added to y once). They loop over the
slots with masks rather than over the sequences, so they never read a device value on the host and
can be captured. A ``prologue`` first makes the GEMM input from what x is (the unfused RMSNorm or
SiLU·mul, as those ops' references round). The Triton kernels are in ``lora_row_triton.py`` (a
one-row step) and ``lora_tile_triton.py`` (tiles of the grouping: every other step).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from kiln.ir.types import TensorType

from .config import DEFAULTS, KernelConfig
from .elementwise import ref_silu_mul
from .lora_groups import grouped_slots
from .lora_row_triton import expand_row, shrink_row
from .lora_tile_triton import expand_tiles, shrink_tiles
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


def ref_lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, lora_rows: torch.Tensor, lora_tiles: torch.Tensor,
                    norm_weight: torch.Tensor | None = None, prologue: str = "none", eps: float = 0.0) -> torch.Tensor:
    """h = x @ A[s].T in f32 for each row of an adapter's tile, zero on rows without one."""
    x = lora_input(x, norm_weight, prologue, eps).float()
    slots = grouped_slots(lora_rows, lora_tiles, lora_a.shape[0])
    h = torch.zeros((x.shape[0], lora_a.shape[1]), dtype=torch.float32, device=x.device)
    for s in range(lora_a.shape[0]):
        h += (x @ lora_a[s].float().T) * (slots == s).to(torch.float32)[:, None]
    return h


def ref_lora_expand(y: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor, lora_rows: torch.Tensor,
                    lora_tiles: torch.Tensor, slices: Sequence[int]) -> torch.Tensor:
    """y plus, per slice i of its columns, ``h[:, i*R:(i+1)*R] @ B[s][slice i].T`` (f32, added once,
    rounded to y's dtype) on each row of an adapter's tile."""
    rank = lora_b.shape[2]
    slots = grouped_slots(lora_rows, lora_tiles, lora_b.shape[0])
    delta = torch.zeros(y.shape, dtype=torch.float32, device=y.device)
    for s in range(lora_b.shape[0]):
        h_s = h * (slots == s).to(torch.float32)[:, None]
        start = 0
        for i, width in enumerate(slices):
            delta[:, start:start + width] += h_s[:, i * rank:(i + 1) * rank] @ lora_b[s, start:start + width].float().T
            start += width
    return (y.float() + delta).to(y.dtype)


def _torch_lora_shrink(x, lora_a, lora_rows, lora_tiles, norm_weight=None, *, out, prologue="none", eps=0.0):
    out.copy_(ref_lora_shrink(x, lora_a, lora_rows, lora_tiles, norm_weight, prologue, eps))


def _torch_lora_expand(y, h, lora_b, lora_rows, lora_tiles, *, slices):
    y.copy_(ref_lora_expand(y, h, lora_b, lora_rows, lora_tiles, slices))
    return y


def _require_grouping(kernel: str, lora_rows: torch.Tensor, lora_tiles: torch.Tensor, *tensors: torch.Tensor) -> None:
    require_device(kernel, lora_rows, lora_tiles, *tensors)
    require_index(kernel, "lora_rows", lora_rows, rank=2)
    require_index(kernel, "lora_tiles", lora_tiles)
    require(all(t.is_contiguous() for t in (lora_rows, *tensors)), kernel,
            lambda: "every operand but lora_tiles must be contiguous")


def triton_lora_shrink(x, lora_a, lora_rows, lora_tiles, norm_weight=None, *, out, prologue="none", eps=0.0,
                       config: KernelConfig = DEFAULTS):
    """A step of one token row takes the one-row kernel (K split over the SMs), others the tiles of
    the step's grouping."""
    _require_grouping("lora_shrink", lora_rows, lora_tiles, x, lora_a, out)
    if x.shape[0] == 0:
        return
    shrink = shrink_row if x.shape[0] == 1 else shrink_tiles
    shrink(x, lora_a, lora_rows, lora_tiles, out, norm_weight if norm_weight is not None else x,
           PROLOGUE_CODES[prologue], eps, config)


def triton_lora_expand(y, h, lora_b, lora_rows, lora_tiles, *, slices, config: KernelConfig = DEFAULTS):
    """As ``triton_lora_shrink``: the one-row kernel or the tiles'."""
    _require_grouping("lora_expand", lora_rows, lora_tiles, y, h, lora_b)
    if y.shape[0] == 0:
        return y
    expand = expand_row if y.shape[0] == 1 else expand_tiles
    expand(y, h, lora_b, lora_rows, lora_tiles, tuple(slices), config)
    return y


def _grouping_is_index(types: Sequence[TensorType]) -> bool:
    return all(t.dtype in IR_INDEXES for t in types)


def _shrink_checker(types: Sequence[TensorType], attrs: Mapping[str, Any]) -> bool:
    return types[0].dtype in IR_FLOATS and _grouping_is_index(types[2:4])


def _expand_checker(types: Sequence[TensorType], attrs: Mapping[str, Any]) -> bool:
    y, _, lora_b = types[:3]
    return (y.dtype in IR_FLOATS and isinstance(lora_b.shape[2], int) and len(attrs["slices"]) <= 3
            and _grouping_is_index(types[3:5]))


register_impl("lora_shrink", "torch", _torch_lora_shrink)
register_impl("lora_shrink", "triton", triton_lora_shrink, checker=_shrink_checker, priority=10, wants_config=True)
register_impl("lora_expand", "torch", _torch_lora_expand)
register_impl("lora_expand", "triton", triton_lora_expand, checker=_expand_checker, priority=10, wants_config=True)
