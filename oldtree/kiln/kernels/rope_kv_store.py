"""The fused rope + KV store (+ Qwen3's q/k norm): its torch reference.

Its Triton kernels are not written here: the compiler generates one per shape into the artifact's
``kernels/`` (``kiln/compiler/codegen/triton_fused.py``), so head counts and dims are constants; not for an FP8 pool, which this reference stores into.
"""

from __future__ import annotations

import torch

from .kv_store import ref_kv_store
from .norm import ref_rmsnorm
from .registry import register_impl
from .rope import ref_rope


def ref_rope_kv_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                      q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                      eps: float = 0.0, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if q_norm is not None:
        q, k = ref_rmsnorm(q, q_norm, eps), ref_rmsnorm(k, k_norm, eps)
    q_rot = ref_rope(q, positions, cos_sin)
    k_cache, v_cache = ref_kv_store(k_cache, v_cache, ref_rope(k, positions, cos_sin), v, slots, k_scale=k_scale,
                                    v_scale=v_scale)
    return q_rot, k_cache, v_cache


def _rope_kv_store(q, k, v, positions, cos_sin, k_cache, v_cache, slots, q_norm=None, k_norm=None, *, out, eps,
                   k_scale=1.0, v_scale=1.0):
    q_rot, _, _ = ref_rope_kv_store(q, k, v, positions, cos_sin, k_cache, v_cache, slots, q_norm, k_norm, eps,
                                    k_scale, v_scale)
    out.copy_(q_rot)


register_impl("rope_kv_store", "torch", _rope_kv_store)
