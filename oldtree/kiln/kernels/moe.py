"""Mixture-of-experts kernels, torch side: the router's top-k, the routed experts (``moe``, and
``moe_residual`` with the residual add after them) and the
shared expert's gate (``sigmoid``, ``scale_rows``), the tokens per expert (``count_experts``, and
``router_topk_count`` with the router), a choice's physical copy
(``place_experts``); the ``ref_`` versions the Triton kernels
(``moe_align.py``, ``moe_gemm.py``) are tested against.

The references compute what the ops' docs say (``kiln/ir/ops_moe.py``): each expert's rows through
its gated MLP in the activation dtype, as HF transformers does, with the routing-weighted sum over a
token's choices taken in f32 and rounded once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .registry import register_impl


def ref_router_topk(logits: torch.Tensor, top_k: int, renormalize: bool = False,
                    scoring: str = "softmax") -> tuple[torch.Tensor, torch.Tensor]:
    if scoring != "softmax":
        raise ValueError(f"router_topk: scoring {scoring!r} is not supported; supported: softmax")
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def ref_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
            w_down: torch.Tensor, expert_offset: int = 0) -> torch.Tensor:
    """Loops over the experts some row chose (data-dependent shapes: it reads the ids on the host)."""
    experts, intermediate = w_gate_up.shape[0], w_down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    local = ids.long() - expert_offset
    for expert in torch.unique(local).tolist():
        if not 0 <= expert < experts:
            continue  # another rank's expert
        rows, choice = torch.where(local == expert)
        gate_up = F.linear(x[rows], w_gate_up[expert])
        act = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        down = F.linear(act, w_down[expert])
        out.index_add_(0, rows, down.float() * weights[rows, choice, None])
    return out.to(x.dtype)


def ref_count_experts(counts: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    real = ids[slots >= 0].long().flatten()
    return counts + torch.bincount(real, minlength=counts.numel())[:counts.numel()]


def ref_place_experts(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    columns = torch.arange(ids.shape[0], device=ids.device) % table.shape[1]
    return table[ids.long(), columns[:, None]].to(ids.dtype)


def ref_sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x)


def ref_scale_rows(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * scale


def _router_topk(logits, *, out, top_k, renormalize=False, scoring="softmax"):
    weights, ids = ref_router_topk(logits, top_k, renormalize, scoring)
    out[0].copy_(weights)
    out[1].copy_(ids)


def _moe(x, weights, ids, w_gate_up, w_down, expert_start=None, *, out, expert_offset=0):
    start = 0 if expert_start is None else int(expert_start)
    out.copy_(ref_moe(x, weights, ids, w_gate_up, w_down, expert_offset + start))


def _moe_residual(x, weights, ids, w_gate_up, w_down, residual, *, out, expert_offset=0):
    # One elementwise add reading both operands before it writes: out may be residual's buffer.
    torch.add(residual, ref_moe(x, weights, ids, w_gate_up, w_down, expert_offset), out=out)


def _count_experts(counts, ids, slots):
    # index_add_ with a 0/1 weight per choice, not bincount: no read back to the host, so a captured
    # step counts too. The op's output is ``counts`` itself, updated in place.
    real = (slots >= 0).to(counts.dtype)[:, None].expand(ids.shape)
    counts.index_add_(0, ids.flatten().long(), real.flatten())
    return counts


def _router_topk_count(logits, counts, slots, *, out, top_k, renormalize=False, scoring="softmax"):
    _router_topk(logits, out=out, top_k=top_k, renormalize=renormalize, scoring=scoring)
    return _count_experts(counts, out[1], slots)


def _place_experts(ids, table, *, out):
    out.copy_(ref_place_experts(ids, table))  # gathers on the device: nothing read back, capturable


def _sigmoid(x, *, out):
    torch.sigmoid(x, out=out)


def _scale_rows(x, scale, *, out):
    torch.mul(x, scale, out=out)


register_impl("router_topk", "torch", _router_topk)
register_impl("moe", "torch", _moe, reads_device=True)
register_impl("moe_residual", "torch", _moe_residual, reads_device=True)
register_impl("count_experts", "torch", _count_experts)
register_impl("router_topk_count", "torch", _router_topk_count)
register_impl("place_experts", "torch", _place_experts)
register_impl("sigmoid", "torch", _sigmoid)
register_impl("scale_rows", "torch", _scale_rows)
