"""The routed experts' Triton kernels: grouped GEMMs over expert-sorted blocks, and a decode path.

``moe`` (``kiln/ir/ops_moe.py``) is two GEMMs per (token, choice) pair, each with the weight of the
pair's expert: gate/up ``[2I, H]`` with SiLU(gate)·up applied as the tile is finished, then down
``[H, I]`` with the pair's routing weight applied the same way; a token's pairs are then summed.

- Many pairs (prefill): ``moe_align.py`` sorts the pairs into runs of one expert, padded to
  ``moe_block_m`` rows; each program of ``_grouped_gemm_kernel`` multiplies one such block by one
  column tile of its expert's weight (``tl.dot``), so each expert's weights are read once per
  block instead of once per pair. This is vLLM's fused_moe layout.
- Few pairs (decode, up to ``moe_decode_max_pairs``): sorting costs more than it saves, so each
  pair reads its expert's weights directly (one token's top-k experts are distinct, so at batch 1
  every active weight is read once), in two launches tiled as gemv.py's one-row GEMV
  (``gemv_config``'s tiles, the next tile's loads before this one's arithmetic, PDL):
  ``_pair_gate_up_kernel`` writes each pair's gate/up row, and ``_pair_down_sum_kernel`` gives each
  token's column tile one program that walks its top-k pairs (silu(gate)·up as gemv.py's SILU_MUL
  prologue), each pair's product times its routing weight summed in one f32 accumulator and
  rounded once, as the reference does. Qwen3-30B-A3B's experts are small (gate/up [1536, 2048],
  down [2048, 768]), so what decides the time is keeping every SM streaming: the tiles are sized
  for the whole grid, and the sum costs no scratch, no third launch and no atomics.

The grouped path writes each pair's weighted down output in f32 to a ``[pairs, H]`` scratch and
then sums a token's choices. ``moe_residual`` (the residual add after the experts, folded in by
``fuse_linear_residual``) is the same launches with the add in the down kernel's epilogue (decode)
or in the sum's (grouped). Pairs of experts that are not local (``expert_offset`` and the rank's
``expert_start``, expert parallelism) contribute zeros.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import triton
import triton.language as tl

from kiln.ir.types import TensorType

from .config import DEFAULTS, KernelConfig
from .gemv import RAW, SILU_MUL, gemv_config, gemv_epilogue, input_tile, tile_input, tile_product, weight_tile
from .moe_align import triton_moe_align
from .registry import register_impl
from .triton_support import (IR_FLOATS, await_previous_kernel, dot_in_f32, pdl_launch, pow2, require,
                             require_device, require_float, sm_count)


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
def _expert_weight(w_ptr, expert_id, live, experts, expert_offset, w_st_e, N):
    # The expert's weight and its rows to load: none for a pair that is not ``live`` (past its
    # token's choices) or of another rank's expert, whose tiles then load nothing (zeros).
    expert = expert_id - expert_offset
    local = live & (expert >= 0) & (expert < experts)
    return w_ptr + tl.where(local, expert, 0).to(tl.int64) * w_st_e, tl.where(local, N, 0)


@triton.jit
def _pair_gate_up_kernel(x_ptr, w_ptr, ids_ptr, y_ptr, experts, expert_offset, N, K, top_k, x_st, w_st_e, w_st, y_st,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    # Program (p, c): columns c*BLOCK_N.. of pair p's x @ w_gate_up[expert].T, as gemv.py's one-row
    # GEMV walks K (the next tile's loads before this tile's arithmetic). Pairs are the grid's fast
    # axis: one column tile of every pair runs at once, so pairs of one expert read it from L2.
    pair = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, 1)
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + (pair // top_k).to(tl.int64) * x_st + rows[:, None]
    # The expert ids are the router's, the kernel before (or two before): wait before reading them.
    await_previous_kernel(PDL)
    w_e, n_rows = _expert_weight(w_ptr, tl.load(ids_ptr + pair), True, experts, expert_offset, w_st_e, N)
    w = weight_tile(w_e, cols, n_rows, w_st, offs_k, K)
    xk, _ = input_tile(x_rows, x_ptr, rows < 1, offs_k, K, RAW)
    acc = tl.zeros([1, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        next_k = k0 + BLOCK_K + offs_k
        w_next = weight_tile(w_e, cols, n_rows, w_st, next_k, K)
        x_next, _ = input_tile(x_rows, x_ptr, rows < 1, next_k, K, RAW)
        acc += tile_product(xk, w, False, False)
        w = w_next
        xk = x_next
    gemv_epilogue(acc, y_ptr, y_ptr, y_ptr + pair.to(tl.int64) * y_st, rows, cols, rows < 1, cols < N, 0, 0,
                  y_ptr.dtype.element_ty, False, False)


@triton.jit
def _pair_down_sum_kernel(h_ptr, w_ptr, ids_ptr, route_ptr, r_ptr, y_ptr, experts, expert_offset, N, K, top_k,
                          h_st, w_st_e, w_st, r_st, y_st, HAS_RESIDUAL: tl.constexpr, TOP_K_POW2: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    # Program (t, c): columns c*BLOCK_N.. of token t's output, the sum over its top_k pairs of
    # route_weight * silu(gate)·up @ w_down[expert].T, in one f32 accumulator walked as one sequence
    # of steps (pair s // k_steps, K tile s % k_steps), the next step's loads before this one's math.
    # Tokens are the fast axis, for L2 hits on shared experts as in the gate/up kernel.
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, 1)
    offs_k = tl.arange(0, BLOCK_K)
    k_steps = tl.cdiv(K, BLOCK_K)
    steps = top_k * k_steps
    first = token * top_k
    # The token's expert ids and routing weights, held in registers: a step's weight address then
    # waits on no load. They come from kernels before the gate/up kernel, which waits for its
    # predecessor before it lets this kernel launch: they are complete here, so they and the first
    # weight tile go out before the wait. gate_up (h) is the kernel before's output: read after it.
    choice = tl.arange(0, TOP_K_POW2)
    ids = tl.load(ids_ptr + first + choice, mask=choice < top_k, other=0)
    routes = tl.load(route_ptr + first + choice, mask=choice < top_k, other=0.0)
    w_e, n_rows = _expert_weight(w_ptr, tl.sum(tl.where(choice == 0, ids, 0)), True, experts, expert_offset,
                                 w_st_e, N)
    w = weight_tile(w_e, cols, n_rows, w_st, offs_k, K)
    await_previous_kernel(PDL)
    hk, up = input_tile(h_ptr + first.to(tl.int64) * h_st + rows[:, None], h_ptr, rows < 1, offs_k, K, SILU_MUL)
    acc = tl.zeros([1, BLOCK_N], tl.float32)
    for step in range(0, steps):
        nxt = step + 1
        live = nxt < steps
        next_choice = nxt // k_steps
        next_k = nxt % k_steps * BLOCK_K + offs_k
        w_e, n_rows = _expert_weight(w_ptr, tl.sum(tl.where(choice == next_choice, ids, 0)), live, experts,
                                     expert_offset, w_st_e, N)
        w_next = weight_tile(w_e, cols, n_rows, w_st, next_k, K)
        h_next, up_next = input_tile(h_ptr + (first + next_choice).to(tl.int64) * h_st + rows[:, None], h_ptr,
                                     (rows < 1) & live, next_k, K, SILU_MUL)
        act = tile_input(hk, up, 0.0, SILU_MUL, h_ptr.dtype.element_ty)
        route = tl.sum(tl.where(choice == step // k_steps, routes, 0.0))
        acc += route * tile_product(act, w, False, False)
        w = w_next
        hk = h_next
        up = up_next
    # moe_residual: the sum rounded, then the residual added, as the unfused add would.
    gemv_epilogue(acc, y_ptr, r_ptr + token.to(tl.int64) * r_st, y_ptr + token.to(tl.int64) * y_st, rows, cols,
                  rows < 1, cols < N, 0, 0, y_ptr.dtype.element_ty, False, HAS_RESIDUAL)


def _check(x, weights, ids, w_gate_up, w_down, residual) -> None:
    kernel = "triton.moe"
    require_float(kernel, "x", x)
    require(residual is None or (residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1),
            kernel, lambda: f"residual {tuple(residual.shape)} {residual.dtype} must be row-major like x")
    require(x.dim() == 2 and x.stride(1) == 1, kernel, lambda: f"x must be a row-major [T, H], got {tuple(x.shape)}")
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        require(w.is_contiguous() and w.dtype == x.dtype, kernel,
                lambda: f"{name} must be contiguous and {x.dtype}, got {w.dtype} strides {w.stride()}")
    require(ids.is_contiguous() and weights.is_contiguous() and weights.dtype == torch.float32, kernel,
            lambda: f"ids and weights must be contiguous, weights f32; got {ids.dtype}, {weights.dtype}")
    require_device(kernel, x, weights, ids, w_gate_up, w_down)


def moe_grouped(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, *, out: torch.Tensor, expert_offset: int = 0,
                residual: torch.Tensor | None = None, config: KernelConfig = DEFAULTS) -> None:
    """The prefill path: pairs sorted into expert blocks, then the two grouped GEMMs."""
    _check(x, weights, ids, w_gate_up, w_down, residual)
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
    summed = partial.view(tokens, top_k, hidden).sum(dim=1)
    if residual is None:
        out.copy_(summed)
    else:  # one elementwise add reading both operands before it writes: out may be residual's buffer
        torch.add(residual, summed.to(out.dtype), out=out)


def moe_decode(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
               w_down: torch.Tensor, *, out: torch.Tensor, expert_offset: int = 0,
               residual: torch.Tensor | None = None, config: KernelConfig = DEFAULTS) -> None:
    """The few-pairs path: each pair's expert read directly (no sorting), two launches tiled as
    gemv.py's one-row GEMV; the sum over a token's choices (and the residual) is the down kernel's."""
    _check(x, weights, ids, w_gate_up, w_down, residual)
    experts, hidden, inter = w_down.shape
    tokens, top_k = ids.shape
    pairs = tokens * top_k
    if pairs == 0:
        return
    gate_up = torch.empty(pairs, 2 * inter, dtype=x.dtype, device=x.device)
    # gemv_config sizes one GEMV's tiles so that every SM gets its programs; the grid holds one
    # GEMV per pair (gate/up) or per token (down), so each needs that many fewer SMs.
    sms = sm_count(x)
    pdl = pdl_launch(x, config.pdl)
    up = gemv_config(1, 2 * inter, hidden, triton.cdiv(sms, pairs), config)
    _pair_gate_up_kernel[(pairs, triton.cdiv(2 * inter, up.block_n))](
        x, w_gate_up, ids, gate_up, experts, expert_offset, 2 * inter, hidden, top_k, x.stride(0),
        w_gate_up.stride(0), w_gate_up.stride(1), gate_up.stride(0), BLOCK_N=up.block_n, BLOCK_K=up.block_k,
        num_warps=config.gemv_num_warps, num_stages=config.gemv_num_stages, **pdl)
    down = gemv_config(1, hidden, inter, triton.cdiv(sms, tokens), config)
    res = residual if residual is not None else out  # never read without HAS_RESIDUAL
    _pair_down_sum_kernel[(tokens, triton.cdiv(hidden, down.block_n))](
        gate_up, w_down, ids, weights, res, out, experts, expert_offset, hidden, inter, top_k, gate_up.stride(0),
        w_down.stride(0), w_down.stride(1), res.stride(0), out.stride(0), HAS_RESIDUAL=residual is not None,
        TOP_K_POW2=pow2(top_k), BLOCK_N=down.block_n, BLOCK_K=down.block_k, num_warps=config.gemv_num_warps,
        num_stages=config.gemv_num_stages, **pdl)


def triton_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
               w_down: torch.Tensor, expert_start: torch.Tensor | None = None, *, out: torch.Tensor,
               expert_offset: int = 0, residual: torch.Tensor | None = None, config: KernelConfig = DEFAULTS) -> None:
    if expert_start is not None:
        # A rank's first expert is a weight (shard_ep), so the ids are shifted on the device: no read
        # back to the host, and a captured step replays it.
        ids = ids - expert_start
    path = moe_decode if ids.numel() <= config.moe_decode_max_pairs else moe_grouped
    path(x, weights, ids, w_gate_up, w_down, out=out, expert_offset=expert_offset, residual=residual, config=config)


def triton_moe_residual(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
                        w_down: torch.Tensor, residual: torch.Tensor, *, out: torch.Tensor, expert_offset: int = 0,
                        config: KernelConfig = DEFAULTS) -> None:
    triton_moe(x, weights, ids, w_gate_up, w_down, out=out, expert_offset=expert_offset, residual=residual,
               config=config)


def _moe_checker(types: Sequence[TensorType], attrs: Mapping[str, Any]) -> bool:
    return types[0].dtype in IR_FLOATS


register_impl("moe", "triton", triton_moe, checker=_moe_checker, priority=10, wants_config=True)
register_impl("moe_residual", "triton", triton_moe_residual, checker=_moe_checker, priority=10, wants_config=True)
