"""Paged attention: each sequence's new tokens attend causally over its whole context in the pool.

Sequence ``b`` owns query rows ``q_start[b] : q_start[b] + q_len[b]`` and a context of
``kv_len[b]`` tokens (the new ones last) whose K/V sit at slots
``page_table[b, j // page_size] * page_size + j % page_size``. Query heads share KV heads in
groups (GQA). The reference loops over sequences on the host; the Triton kernels do not.
"""

from __future__ import annotations

import torch

from .registry import register_impl


def context_slots(page_row: torch.Tensor, length: int, page_size: int) -> torch.Tensor:
    """The pool slots of the first ``length`` tokens of a sequence with page-table row ``page_row``."""
    positions = torch.arange(length, device=page_row.device)
    return page_row[positions // page_size].long() * page_size + positions % page_size


def ref_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_start: torch.Tensor,
                        q_len: torch.Tensor, kv_len: torch.Tensor, page_table: torch.Tensor, *, scale: float,
                        page_size: int, sliding_window: int = 0, soft_cap: float = 0.0) -> torch.Tensor:
    out = torch.zeros_like(q)
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    group = heads // kv_heads
    for b, (start, n, length) in enumerate(zip(q_start.tolist(), q_len.tolist(), kv_len.tolist())):
        if n == 0:
            continue
        slots = context_slots(page_table[b], length, page_size)
        k = k_cache[slots].float().repeat_interleave(group, dim=1)  # [L, H, D]
        v = v_cache[slots].float().repeat_interleave(group, dim=1)
        qs = q[start:start + n].float()  # [n, H, D]
        scores = torch.einsum("nhd,lhd->hnl", qs, k) * scale
        if soft_cap > 0:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = torch.arange(length - n, length, device=q.device)[:, None]
        k_pos = torch.arange(length, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window > 0:
            allowed &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:start + n] = torch.einsum("hnl,lhd->nhd", probs, v).to(q.dtype)
    return out


def _paged_attention(q, k_cache, v_cache, q_start, q_len, kv_len, page_table, *, out, **attrs):
    out.copy_(ref_paged_attention(q, k_cache, v_cache, q_start, q_len, kv_len, page_table, **attrs))


register_impl("paged_attention", "torch", _paged_attention)
