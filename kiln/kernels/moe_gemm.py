"""The routed experts' Triton kernels: grouped GEMMs over expert-sorted blocks, and a decode path.

``moe`` (``kiln/ir/ops_moe.py``) is two GEMMs per (token, choice) pair, each with the weight of the
pair's expert: gate/up ``[2I, H]`` with SiLU(gate)·up applied as the tile is finished, then down
``[H, I]`` with the pair's routing weight applied the same way; a token's pairs are then summed.

- Many pairs (prefill): ``moe_align.py`` sorts the pairs into runs of one expert, padded to
  ``moe_block_m`` rows; each program of ``_grouped_gemm_kernel`` multiplies one such block by one
  column tile of its expert's weight (``tl.dot``), so each expert's weights are read once per
  block instead of once per pair. This is vLLM's fused_moe layout.
- Few pairs (decode, up to ``moe_decode_max_pairs``): sorting costs more than it saves, so
  ``_pair_gemv_kernel`` gives each pair its own programs, reading its expert's weight directly
  (one token's top-k experts are distinct, so at batch 1 every active weight is read once).

Both write each pair's weighted down output in f32 to a ``[pairs, H]`` scratch; the sum over a
token's choices then rounds once, as the reference does. Pairs of experts that are not local
(``expert_offset`` and the rank's ``expert_start``, expert parallelism) contribute zeros.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import triton
import triton.language as tl

from kiln.ir.types import TensorType

from .config import DEFAULTS, KernelConfig
from .moe_align import triton_moe_align
from .registry import register_impl
from .triton_support import IR_FLOATS, dot_in_f32, pow2, require, require_device, require_float


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, out_ptr, route_ptr, sorted_ptr, block_experts_ptr, total_ptr,
                         pairs, n_out, k_in, a_row_div, a_stride, w_stride_e, w_stride_n, out_stride, up_offset,
                         GATED: tl.constexpr, WEIGHTED: tl.constexpr, DOT_F32: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return  # the grid is sized for the most blocks a step can need
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pair < pairs
    a_row = (pair // a_row_div).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    w_base = w_ptr + expert * w_stride_e + cols[None, :].to(tl.int64) * w_stride_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_in
        a = tl.load(a_ptr + a_row[:, None] * a_stride + ks[None, :], mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w = tl.load(w_base + ks[:, None], mask=w_mask, other=0.0)
        if DOT_F32:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
        if GATED:
            w_up = tl.load(w_base + up_offset + ks[:, None], mask=w_mask, other=0.0)
            if DOT_F32:
                acc_up += tl.dot(a.to(tl.float32), w_up.to(tl.float32), input_precision="ieee")
            else:
                acc_up += tl.dot(a, w_up)
    result = acc
    if GATED:
        result = acc / (1.0 + tl.exp(-acc)) * acc_up
    if WEIGHTED:
        result = result * tl.load(route_ptr + pair, mask=pair_ok, other=0.0)[:, None]
    tl.store(out_ptr + pair[:, None].to(tl.int64) * out_stride + cols[None, :],
             result.to(out_ptr.dtype.element_ty), mask=pair_ok[:, None] & col_ok[None, :])


@triton.jit
def _pair_gemv_kernel(a_ptr, w_ptr, out_ptr, route_ptr, ids_ptr, experts, expert_offset,
                      n_out, k_in, a_row_div, a_stride, w_stride_e, w_stride_n, out_stride, up_offset,
                      GATED: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64) - expert_offset
    local = (expert >= 0) & (expert < experts)
    expert = tl.where(local, expert, 0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    w_base = w_ptr + expert * w_stride_e + cols[:, None].to(tl.int64) * w_stride_n
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_in
        a = tl.load(a_ptr + (pair // a_row_div) * a_stride + ks, mask=k_ok & local, other=0.0).to(tl.float32)
        # A pair of another rank's expert loads nothing (masked) and so writes zeros.
        w_mask = col_ok[:, None] & k_ok[None, :] & local
        acc += tl.sum(tl.load(w_base + ks[None, :], mask=w_mask, other=0.0).to(tl.float32) * a[None, :], axis=1)
        if GATED:
            w_up = tl.load(w_base + up_offset + ks[None, :], mask=w_mask, other=0.0).to(tl.float32)
            acc_up += tl.sum(w_up * a[None, :], axis=1)
    result = acc
    if GATED:
        result = acc / (1.0 + tl.exp(-acc)) * acc_up
    if WEIGHTED:
        result = result * tl.load(route_ptr + pair)
    tl.store(out_ptr + pair * out_stride + cols, result.to(out_ptr.dtype.element_ty), mask=col_ok)


def _check(x, weights, ids, w_gate_up, w_down) -> None:
    kernel = "triton.moe"
    require_float(kernel, "x", x)
    require(x.dim() == 2 and x.stride(1) == 1, kernel, lambda: f"x must be a row-major [T, H], got {tuple(x.shape)}")
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        require(w.is_contiguous() and w.dtype == x.dtype, kernel,
                lambda: f"{name} must be contiguous and {x.dtype}, got {w.dtype} strides {w.stride()}")
    require(ids.is_contiguous() and weights.is_contiguous() and weights.dtype == torch.float32, kernel,
            lambda: f"ids and weights must be contiguous, weights f32; got {ids.dtype}, {weights.dtype}")
    require_device(kernel, x, weights, ids, w_gate_up, w_down)


def moe_grouped(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, *, out: torch.Tensor, expert_offset: int = 0,
                config: KernelConfig = DEFAULTS) -> None:
    """The prefill path: pairs sorted into expert blocks, then the two grouped GEMMs."""
    _check(x, weights, ids, w_gate_up, w_down)
    experts, hidden, inter = w_down.shape
    tokens, top_k = ids.shape
    pairs = tokens * top_k
    bm, bn, bk = config.moe_block_m, config.moe_block_n, config.moe_block_k
    sorted_pairs, block_experts, total = triton_moe_align(ids, experts, bm, expert_offset)
    blocks = block_experts.numel()
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    partial = torch.zeros(pairs, hidden, dtype=torch.float32, device=x.device)  # non-local pairs stay zero
    common = dict(DOT_F32=dot_in_f32(x.dtype), BLOCK_M=bm, BLOCK_K=bk, num_warps=4)
    _grouped_gemm_kernel[(blocks, triton.cdiv(inter, bn))](
        x, w_gate_up, act, weights, sorted_pairs, block_experts, total, pairs, inter, hidden, top_k, x.stride(0),
        w_gate_up.stride(0), w_gate_up.stride(1), act.stride(0), inter * w_gate_up.stride(1),
        GATED=True, WEIGHTED=False, BLOCK_N=bn, **common)
    _grouped_gemm_kernel[(blocks, triton.cdiv(hidden, bn))](
        act, w_down, partial, weights, sorted_pairs, block_experts, total, pairs, hidden, inter, 1, act.stride(0),
        w_down.stride(0), w_down.stride(1), partial.stride(0), 0,
        GATED=False, WEIGHTED=True, BLOCK_N=bn, **common)
    out.copy_(partial.view(tokens, top_k, hidden).sum(dim=1))


def moe_decode(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
               w_down: torch.Tensor, *, out: torch.Tensor, expert_offset: int = 0,
               config: KernelConfig = DEFAULTS) -> None:
    """The few-pairs path: per-pair GEMVs reading each pair's expert weight directly, no sorting."""
    _check(x, weights, ids, w_gate_up, w_down)
    experts, hidden, inter = w_down.shape
    tokens, top_k = ids.shape
    pairs = tokens * top_k
    if pairs == 0:
        return
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    partial = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    bn, bk = config.moe_gemv_block_n, config.moe_gemv_block_k
    _pair_gemv_kernel[(pairs, triton.cdiv(inter, bn))](
        x, w_gate_up, act, weights, ids, experts, expert_offset, inter, hidden, top_k, x.stride(0),
        w_gate_up.stride(0), w_gate_up.stride(1), act.stride(0), inter * w_gate_up.stride(1),
        GATED=True, WEIGHTED=False, BLOCK_N=bn, BLOCK_K=min(bk, pow2(hidden)), num_warps=4)
    _pair_gemv_kernel[(pairs, triton.cdiv(hidden, bn))](
        act, w_down, partial, weights, ids, experts, expert_offset, hidden, inter, 1, act.stride(0),
        w_down.stride(0), w_down.stride(1), partial.stride(0), 0,
        GATED=False, WEIGHTED=True, BLOCK_N=bn, BLOCK_K=min(bk, pow2(inter)), num_warps=4)
    out.copy_(partial.view(tokens, top_k, hidden).sum(dim=1))


def triton_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
               w_down: torch.Tensor, expert_start: torch.Tensor | None = None, *, out: torch.Tensor,
               expert_offset: int = 0, config: KernelConfig = DEFAULTS) -> None:
    if expert_start is not None:
        # A rank's first expert is a weight (shard_ep), so the ids are shifted on the device: no read
        # back to the host, and a captured step replays it.
        ids = ids - expert_start
    path = moe_decode if ids.numel() <= config.moe_decode_max_pairs else moe_grouped
    path(x, weights, ids, w_gate_up, w_down, out=out, expert_offset=expert_offset, config=config)


def _moe_checker(types: Sequence[TensorType], attrs: Mapping[str, Any]) -> bool:
    return types[0].dtype in IR_FLOATS


register_impl("moe", "triton", triton_moe, checker=_moe_checker, priority=10, wants_config=True)
