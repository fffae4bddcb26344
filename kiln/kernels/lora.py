"""Batched multi-LoRA: the ``lora`` op (``kiln/ir/ops_lora.py``), each token row's adapter update.

``ref_lora`` is the plain-torch definition: every token takes its sequence's slot (``lora_slot[b]``
for the rows ``q_start[b] .. q_start[b] + q_len[b]``; -1: the base model, no update), then
``h = x @ A[s].T`` (the shrink, f32) and, per slice ``i`` of y's columns,
``y[:, slice i] += h[:, i*R:(i+1)*R] @ B[s][slice i].T`` (the expand, f32, added to y once). It
loops over the slots with masks rather than over the sequences, so it never reads a device value
on the host and can be captured. A ``prologue`` first makes the GEMM input from what x is (the
unfused RMSNorm or SiLU·mul, as those ops' references round). The Triton kernels are in
``lora_triton.py`` (segments) and ``lora_decode_triton.py`` (decode steps).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from kiln.ir.types import TensorType

from .config import DEFAULTS, KernelConfig
from .elementwise import ref_silu_mul
from .lora_decode_triton import launch_decode
from .lora_triton import PROLOGUE_CODES, launch_segments
from .norm import ref_rmsnorm
from .registry import register_impl
from .triton_support import IR_FLOATS, IR_INDEXES, require, require_device, require_index


def token_slots(tokens: int, lora_slot: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor) -> torch.Tensor:
    """Each token row's adapter slot: its sequence's, or -1 (a base-model or padding row)."""
    rows = torch.arange(tokens, device=lora_slot.device)[:, None]
    inside = (rows >= q_start[None, :]) & (rows < (q_start + q_len)[None, :])
    return torch.where(inside, lora_slot[None, :].to(torch.int64), -1).amax(dim=1) if q_start.numel() else \
        torch.full((tokens,), -1, dtype=torch.int64, device=lora_slot.device)


def lora_input(x: torch.Tensor, norm_weight: torch.Tensor | None, prologue: str, eps: float) -> torch.Tensor:
    """The GEMM input the update multiplies: x, or the RMSNorm / SiLU·mul the prologue names, of x."""
    if prologue == "rmsnorm":
        return ref_rmsnorm(x, norm_weight, eps).to(x.dtype)
    if prologue == "silu_mul":
        return ref_silu_mul(*x.chunk(2, dim=-1))
    return x


def ref_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, lora_slot: torch.Tensor,
             q_start: torch.Tensor, q_len: torch.Tensor, slices: Sequence[int], norm_weight: torch.Tensor | None = None,
             prologue: str = "none", eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(y plus each row's update, in y's dtype; the shrink h, zero on rows without an adapter)."""
    x = lora_input(x, norm_weight, prologue, eps)
    rank = lora_b.shape[2]
    slots = token_slots(x.shape[0], lora_slot, q_start, q_len)
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


def _torch_lora(y, x, lora_a, lora_b, lora_slot, q_start, q_len, norm_weight=None, *, out, slices, prologue="none",
                eps=0.0):
    updated, h = ref_lora(y, x, lora_a, lora_b, lora_slot, q_start, q_len, slices, norm_weight, prologue, eps)
    y.copy_(updated)
    out.copy_(h)
    return y


def triton_lora(y, x, lora_a, lora_b, lora_slot, q_start, q_len, norm_weight=None, *, out, slices, prologue="none",
                eps=0.0, sizes=None, config: KernelConfig = DEFAULTS):
    """Decode steps (every sequence one token: ``max_q_len`` 1) take the decode kernels
    (``lora_decode_triton.py``), others the segment kernels (SGMV) with a grid sized by the longest
    sequence."""
    require_device("lora", y, x, lora_a, lora_b, lora_slot, q_start, q_len, out)
    for name, t in (("lora_slot", lora_slot), ("q_start", q_start), ("q_len", q_len)):
        require_index("lora", name, t)
    require(all(t.is_contiguous() for t in (y, x, lora_a, lora_b, out)), "lora",
            lambda: "y, x, lora_a, lora_b and h must be contiguous")
    max_q_len = (sizes or {}).get("max_q_len")
    tokens = x.shape[0]
    bound = tokens if max_q_len is None else min(max_q_len, tokens)
    norm = norm_weight if norm_weight is not None else x
    if bound == 1:
        launch_decode(y, x, lora_a, lora_b, lora_slot, q_start, q_len, out, tuple(slices), norm,
                      PROLOGUE_CODES[prologue], eps, config)
    else:
        launch_segments(y, x, lora_a, lora_b, lora_slot, q_start, q_len, out, tuple(slices), bound, norm,
                        PROLOGUE_CODES[prologue], eps)
    return y


def _checker(types: Sequence[TensorType], attrs: Mapping[str, Any]) -> bool:
    y, x, lora_a, lora_b, *indexes = types[:7]
    return (y.dtype in IR_FLOATS and isinstance(lora_b.shape[2], int) and len(attrs["slices"]) <= 3
            and all(t.dtype in IR_INDEXES for t in indexes))


register_impl("lora", "torch", _torch_lora)
register_impl("lora", "triton", triton_lora, checker=_checker, priority=10, wants_sizes=True, wants_config=True)
