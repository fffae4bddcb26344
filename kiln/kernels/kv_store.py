"""Writing each token's K and V into its slot of the paged pool (slot -1: a padding token, skipped)."""

from __future__ import annotations

import torch

from .registry import register_impl


def ref_kv_store(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    keep = slots >= 0
    index = slots[keep].long()
    k_cache[index] = k[keep]
    v_cache[index] = v[keep]
    return k_cache, v_cache


register_impl("kv_store", "torch", ref_kv_store)
