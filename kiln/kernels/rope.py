"""Rotary position embedding (half-split layout) from a precomputed f32 cos/sin table.

The table is ``[max_positions, rot]``: columns ``[:rot/2]`` hold cos, ``[rot/2:]`` sin, already
scaled by the rope variant's attention factor. Only the first ``rot`` dims of each head rotate.
"""

from __future__ import annotations

import torch

from .registry import register_impl


def ref_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    # The products happen in x's dtype, as in HF's apply_rotary_pos_emb, so bf16 results agree.
    rot = cos_sin.shape[1]
    half = rot // 2
    table = cos_sin[positions.long()]
    cos = table[:, None, :half].to(x.dtype)
    sin = table[:, None, half:].to(x.dtype)
    x1, x2, rest = x[..., :half], x[..., half:rot], x[..., rot:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def _rope(x, positions, cos_sin, *, out):
    out.copy_(ref_rope(x, positions, cos_sin))


register_impl("rope", "torch", _rope)
