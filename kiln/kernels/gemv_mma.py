"""The quantized GEMV on Hopper's tensor cores: the weight tile is the matrix product's left operand.

At a few rows a GEMM's time is its weight bytes over the memory's rate, if the kernel does little per
weight. ``gemv_quantized_row``'s broadcast product decodes every weight with integer bit moves and
multiplies in f32, ~8 instructions a weight for fp8, which on sm_90 holds it near 64% of the fp8
roofline (MXFP4 48%). Hopper's warpgroup MMA (wgmma) takes e4m3 and int8 operands as they are stored,
with no thread touching a weight value, but its left operand is 64 rows tall and x has 1-16 rows. So
the product is computed transposed, ``y.T = W @ x.T``: 64 weight rows are the MMA's rows and x's rows,
padded to 16, its columns (``m64n16k32``; a normal ``x @ W.T`` would pad x to 64 rows and, at fewer,
go through mma.sync with every e4m3 weight converted to f16). Triton lowers the ``tl.dot`` to wgmma
and streams the weight tiles through shared memory ahead of it (``num_stages``).

- W8A8 (``fp8_channel`` with fp8 activations, ``int8_channel`` with int8): x comes quantized per token
  (``act_quant_triton.quantize_rows``, the RMSNorm or SiLU·mul prologue applied there), the 8-bit
  values are multiplied as stored, and the epilogue multiplies each sum by its channel's and its row's
  scale (int8's exact int32 sums first converted);
- weight-only (``int8_channel``, ``mxfp4``): the prologue runs as its own kernel, the weight tile is
  decoded in registers to x's dtype (wgmma takes its left operand from registers; int8 and scaled
  e2m1 values are exact in bf16), MXFP4 as ``gemv_quantized`` decodes it (low nibbles times x's even
  elements, high nibbles its odd ones).

The bias or residual is added by ``gemv.gemv_epilogue``, so the result is ``gemv_quantized``'s.
64-row tiles leave Llama-3-8B's 4096-column GEMMs 64 programs for 132 SMs, so K is split until each SM
has its programs; the partial sums meet in a workspace and the tile's last split adds them in split
order: deterministic, as the other GEMVs are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ir.weights import QuantScheme

from .act_quant_triton import ACT_FP8, ACT_INT8, ACT_KINDS, ACT_NONE, quantize_rows
from .config import DEFAULTS, KernelConfig
from .elementwise import triton_silu_mul
from .gemv import gemv_epilogue
from .gemv_quantized import decode_pairs, load_weight
from .norm import triton_rmsnorm
from .quant_decode import MXFP4, PER_CHANNEL
from .triton_support import INTERPRET, await_previous_kernel, dot_in_f32, pdl_launch, pow2, sm_count

# wgmma's left operand is 64 rows (a warpgroup's tile); its right operand 8-256 columns, 16 here at
# least (tl.dot's smallest).
MMA_ROWS = 64
MIN_BLOCK_T = 16


@triton.jit
def _mma_gemv_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, b_ptr, r_ptr, y_ptr, part_ptr, count_ptr, T, N, K, K_SPLIT,
                     x_st, w_st, s_st, r_st, y_st, WEIGHT: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr):
    # Program (p, q, r) computes output columns p*BLOCK_N.. of rows q*BLOCK_T.. as acc[column, row],
    # over the r-th K_SPLIT values of K.
    dtype = y_ptr.dtype.element_ty
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    k_start = tl.program_id(2) * K_SPLIT
    k_end = tl.minimum(K, k_start + K_SPLIT)
    col_mask = cols < N
    row_mask = rows < T
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_st
    await_previous_kernel(PDL)  # x is the previous kernel's output
    if ACT == ACT_INT8:
        acc = tl.zeros([BLOCK_N, BLOCK_T], tl.int32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        w, s = load_weight(w_ptr, s_ptr, cols, N, w_st, s_st, k0, K, WEIGHT, BLOCK_K)
        if WEIGHT == MXFP4:
            # Decoded in registers (wgmma takes its left operand from there) and multiplied by x's even
            # and odd elements, loaded at stride 2, as gemv_quantized does.
            even, odd = decode_pairs(w, s)
            k = k0 + 2 * tl.arange(0, BLOCK_K // 2)
            x_mask = row_mask[:, None] & (k < K)[None, :]
            x_even = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0)
            x_odd = tl.load(x_rows + k[None, :] + 1, mask=x_mask, other=0.0)
            acc += _dot(even, x_even, ACT, DOT_F32, dtype) + _dot(odd, x_odd, ACT, DOT_F32, dtype)
        else:
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + k[None, :], mask=row_mask[:, None] & (k < K)[None, :], other=0.0)
            acc += _dot(w, x, ACT, DOT_F32, dtype)
    if SPLIT_K > 1:
        # Each split leaves its partial sums in the workspace; the tile's last split to finish (its
        # counter says so) adds all of them in split order, so the result does not depend on which
        # finished when, and sets the counter back to 0 for the next launch.
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        local = tl.arange(0, BLOCK_N)[:, None] * BLOCK_T + tl.arange(0, BLOCK_T)[None, :]
        tile_parts = part_ptr + tile.to(tl.int64) * SPLIT_K * BLOCK_N * BLOCK_T
        tl.store(tile_parts + tl.program_id(2) * BLOCK_N * BLOCK_T + local, acc)
        tl.debug_barrier()  # every thread's partials written before the counter moves
        if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") != SPLIT_K - 1:
            return
        acc = tl.load(tile_parts + local, cache_modifier=".cg")
        for split in range(1, SPLIT_K):
            acc += tl.load(tile_parts + split * BLOCK_N * BLOCK_T + local, cache_modifier=".cg")
        tl.store(count_ptr + tile, 0)
    scaled = acc.to(tl.float32)
    if WEIGHT != MXFP4:
        scaled *= tl.load(s_ptr + cols, mask=col_mask, other=0.0)[:, None]
    if ACT != ACT_NONE:
        scaled *= tl.load(xs_ptr + rows, mask=row_mask, other=1.0)[None, :]
    gemv_epilogue(tl.trans(scaled), b_ptr, r_ptr, y_ptr, rows, cols, row_mask, col_mask, r_st, y_st, dtype,
                  HAS_BIAS, HAS_RESIDUAL)


@triton.jit
def _dot(w, x, ACT: tl.constexpr, DOT_F32: tl.constexpr, dtype: tl.constexpr):
    # w @ x.T: 8-bit values of W8A8 as they are (int8 into exact int32 sums, e4m3 into f32); decoded
    # weight-only values in x's dtype (int8 and scaled e2m1 values are exact in bf16). DOT_F32: f32
    # copies, for f32 x and for the interpreter, which multiplies bf16 and 8-bit bit patterns.
    if DOT_F32:
        out = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
        if ACT == ACT_INT8:
            out = out.to(tl.int32)
    elif ACT == ACT_INT8:
        out = tl.dot(w, tl.trans(x), out_dtype=tl.int32)
    elif ACT == ACT_FP8:
        out = tl.dot(w, tl.trans(x))
    else:
        out = tl.dot(w.to(dtype), tl.trans(x))
    return out


def mma_gemv_tiles(rows: int, n: int, k: int, sms: int, pack: int = 1,
                   config: KernelConfig = DEFAULTS) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_T, BLOCK_K, SPLIT_K) of the MMA GEMV for ``rows`` rows of an [n, k] weight stored
    ``pack`` values a byte: K split until the grid gives each of the ``sms`` SMs
    ``mma_gemv_programs_per_sm`` programs (at most one split a K step; MXFP4 splits at whole blocks)."""
    block_t = max(MIN_BLOCK_T, pow2(rows))
    block_k = min(config.mma_gemv_block_k, pow2(k, 32))
    tiles = triton.cdiv(n, MMA_ROWS) * triton.cdiv(rows, block_t)
    split = max(1, min(triton.cdiv(k, block_k), triton.cdiv(sms * config.mma_gemv_programs_per_sm, tiles)))
    return MMA_ROWS, block_t, block_k, split


# Split-K tile counters, zero between launches (each launch's last splits set theirs back): one
# buffer a device, made before any CUDA graph capture (kernel warm-up runs each step eagerly first).
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < tiles:
        counters = _COUNTERS[device] = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
    return counters


def launch_mma_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out: torch.Tensor, *,
                    scheme: QuantScheme, act_quant: str | None, norm_weight: torch.Tensor | None = None,
                    gated: bool = False, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                    eps: float = 0.0, config: KernelConfig = DEFAULTS) -> None:
    """``gemv_quantized.launch_quantized_gemv``'s result for checked operands, two launches: the GEMM's
    input made first (W8A8: quantized per token with the prologue applied; weight-only: the RMSNorm or
    SiLU·mul by its own kernel, if any), then the transposed tensor-core GEMV on it."""
    rows, n, k = x.shape[0], weight.shape[0], weight.shape[1] * scheme.pack
    if rows == 0 or n == 0:
        return
    if act_quant is not None:
        x, x_scale = quantize_rows(x, act_quant, norm_weight=norm_weight, gated=gated, eps=eps, config=config)
    else:
        x_scale = x
        if norm_weight is not None:
            normed = torch.empty(rows, k, dtype=x.dtype, device=x.device)
            triton_rmsnorm(x, norm_weight, out=normed, eps=eps, config=config)
            x = normed
        elif gated:
            activated = torch.empty(rows, k, dtype=x.dtype, device=x.device)
            triton_silu_mul(*x.chunk(2, dim=-1), out=activated, config=config)
            x = activated
    block_n, block_t, block_k, split = mma_gemv_tiles(rows, n, k, sm_count(x), scheme.pack, config)
    grid = (triton.cdiv(n, block_n), triton.cdiv(rows, block_t), split)
    k_split = triton.cdiv(triton.cdiv(k, block_k), split) * block_k
    parts = counters = out
    if split > 1:
        # int8's partial sums stay int32 (exact); the others are f32.
        parts = torch.empty(grid[0] * grid[1] * split * block_n * block_t, device=x.device,
                            dtype=torch.int32 if act_quant == "int8_per_token" else torch.float32)
        counters = _counters(x.device, grid[0] * grid[1])
    res = residual if residual is not None else out
    _mma_gemv_kernel[grid](
        x, x_scale, weight, weight_scale, bias if bias is not None else out, res, out, parts, counters, rows, n, k,
        k_split, x.stride(0), weight.stride(0), weight_scale.stride(0), res.stride(0), out.stride(0),
        WEIGHT=MXFP4 if scheme.block is not None else PER_CHANNEL, ACT=ACT_KINDS[act_quant],
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        DOT_F32=INTERPRET or (act_quant is None and dot_in_f32(x.dtype)), BLOCK_N=block_n, BLOCK_T=block_t,
        BLOCK_K=block_k, SPLIT_K=split, num_warps=4, num_stages=config.mma_gemv_num_stages,
        **pdl_launch(x, config.pdl))
