"""Row-wise argmax of logits ``[R, V]``: the greedy token of every sequence in a decode step.

torch's argmax reduces a row in one thread block, so one row of a 128k vocabulary takes ~28 µs on an
H200, a sizeable part of a small model's decode step. Here grid ``(rows, chunks)`` cuts each row
into equal chunks, enough of them that the GPU's SMs all get work even at batch 1. Program
``(r, c)`` reduces chunk ``c`` of row ``r`` to its best element; with one chunk it writes the row's
result itself, with several it stores a partial and takes a ticket from the row's counter, and the
program that draws the last ticket reduces the row's partials, writes the result and puts the
counter back to zero (the pattern of ``attention_decode``, which shares the counters: see
``triton_support.semaphore_counters``). One launch, no host synchronization, so it can be captured
in the decode step's CUDA graph.

Which index wins is torch's rule on CPU and CUDA (ATen's ``GreaterOrNan`` comparator): the first
NaN of the row if it has one, else the first occurrence of the maximum, with -0.0 equal to 0.0.
Rather than compare (value, index) pairs, every element becomes one int64 whose order is that rule:
an order-preserving integer key of the f32 value in the high 32 bits (NaN above +inf, both zeros
one key) and ``2^31 - 1 - index`` in the low 32 bits, so a plain integer max picks the largest
value and, among equal ones, the lowest index, within a program and across the partials alike.
f16 and bf16 inputs are compared as their (exact) f32 values.

With a packed token ``bitmask`` (the grammar's, in the layout of ``bitmask.py``) the elements it
disallows count as -inf, as if the mask had been applied to the logits first: a grammar-constrained
greedy token in one launch, with the logits neither copied nor written.

Registered as the runtime op ``argmax_rows`` (``registry.impl_for_device``): the sampler and the
decode graphs call it on a step's logits, not a program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .bitmask import bitmask_width, unpack_bitmask
from .config import DEFAULTS, KernelConfig
from .registry import register_impl
from .triton_support import (await_previous_kernel, pdl_launch, pow2, require, require_device, require_float,
                             require_unit_last_stride, semaphore_counters, sm_count)

# The packed value of masked-off elements and of empty merge lanes: below every real element's.
_FLOOR = tl.constexpr(-(2 ** 63))


def ref_argmax_rows(x: torch.Tensor, bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """int64 ``[R]``: the index of each row's maximum (the first NaN, else the first maximum), over
    the elements ``bitmask`` allows when given (a row allowing nothing gives 0)."""
    if bitmask is not None:
        x = x.masked_fill(~unpack_bitmask(bitmask, x.shape[1]), float("-inf"))
    return x.argmax(dim=-1)


@triton.jit
def _packed(x, idx):
    # The int64 whose order is argmax's order (see the module docstring). The key of a finite or
    # infinite f32 is its magnitude's bits, negated for negative values: -0.0 and 0.0 both get 0,
    # -inf gets -0x7F800000, and every NaN (magnitude above +inf's) gets the largest key of all,
    # 0x7FFFFFFF = 2^31 - 1.
    bits = x.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    key = tl.where(magnitude > 0x7F800000, 0x7FFFFFFF, tl.where(bits < 0, -magnitude, magnitude))
    return (key.to(tl.int64) << 32) | (0x7FFFFFFF - idx).to(tl.int64)


@triton.jit
def _index_of(packed):
    # The low 32 bits hold 2^31 - 1 - index (non-negative, so the truncation keeps it as is).
    return (0x7FFFFFFF - packed.to(tl.int32)).to(tl.int64)


@triton.jit
def _argmax_kernel(x_ptr, mask_ptr, out_ptr, mirror_ptr, part_ptr, counter_ptr, vocab, x_stride, mask_stride, chunk,
                   num_chunks, MASKED: tl.constexpr, MIRROR: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                   MERGE: tl.constexpr, PDL: tl.constexpr):
    await_previous_kernel(PDL)
    row = tl.program_id(0)
    c = tl.program_id(1)
    start = c * chunk
    end = tl.minimum(start + chunk, vocab)
    row_ptr = x_ptr + row.to(tl.int64) * x_stride
    mask_row = mask_ptr + row.to(tl.int64) * mask_stride
    offs = tl.arange(0, BLOCK)
    # Each lane keeps its own running best and the lanes are reduced once, after the loop.
    best = tl.full([BLOCK], _FLOOR, tl.int64)
    for i0 in range(start, end, BLOCK):
        idx = i0 + offs
        mask = idx < end
        # f32 for every input dtype: the key is built from f32 bits (and the interpreter cannot do
        # bf16 arithmetic).
        x = tl.load(row_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        if MASKED:
            # Bit idx % 32 of word idx // 32; the 32 lanes reading one word hit the same cache line.
            words = tl.load(mask_row + idx // 32, mask=mask, other=0)
            x = tl.where(((words >> (idx % 32)) & 1) != 0, x, float("-inf"))
        best = tl.maximum(best, tl.where(mask, _packed(x, idx), _FLOOR))
    best_of_chunk = tl.max(best, 0)
    if SPLIT:
        first = row * num_chunks
        tl.store(part_ptr + first + c, best_of_chunk)
        # The last ticket sees every chunk's partial on a GPU for the reasons given at the same
        # barrier + acq_rel atomic in attention_decode._decode_kernel: the barrier orders this
        # program's store before the atomic, whose gpu-scope release publishes it; the tickets form
        # one release sequence, so the atomic that returns num_chunks - 1 acquires every other
        # chunk's store; the merge loads from L2 (.cg). The reset is ordered before the next launch
        # by the stream, and no program of this launch touches the counter after its ticket.
        tl.debug_barrier()
        counter = counter_ptr + row
        ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if ticket == num_chunks - 1:
            # Every chunk's partial, this program's own included.
            best_of_row = best_of_chunk
            for c0 in range(0, num_chunks, MERGE):
                cs = c0 + tl.arange(0, MERGE)
                parts = tl.load(part_ptr + first + cs, mask=cs < num_chunks, other=_FLOOR, cache_modifier=".cg")
                best_of_row = tl.maximum(best_of_row, tl.max(parts, 0))
            _store_result(out_ptr, mirror_ptr, row, best_of_row, MIRROR)
            tl.store(counter, 0)
    else:
        _store_result(out_ptr, mirror_ptr, row, best_of_chunk, MIRROR)


@triton.jit
def _store_result(out_ptr, mirror_ptr, row, best, MIRROR: tl.constexpr):
    index = _index_of(best)
    tl.store(out_ptr + row, index.to(out_ptr.dtype.element_ty))
    if MIRROR:
        # A store to pinned host memory (unified addressing): posted across PCIe, it costs the kernel
        # no round trip, and it is visible to the host once the stream has passed the kernel.
        tl.store(mirror_ptr + row, index.to(mirror_ptr.dtype.element_ty))


def argmax_chunk(rows: int, vocab: int, sm_count: int, config: KernelConfig = DEFAULTS) -> int:
    """Elements per chunk: whole ``config.argmax_block`` steps, as many chunks as make about
    ``argmax_programs_per_sm`` programs per SM, but never more chunks than steps."""
    block = config.argmax_block
    chunks = min(triton.cdiv(config.argmax_programs_per_sm * sm_count, rows), triton.cdiv(vocab, block))
    return triton.cdiv(triton.cdiv(vocab, chunks), block) * block


def triton_argmax_rows(x: torch.Tensor, out: torch.Tensor | None = None, *, bitmask: torch.Tensor | None = None,
                       mirror: torch.Tensor | None = None, chunk: int | None = None,
                       config: KernelConfig = DEFAULTS) -> torch.Tensor:
    """int64 ``[R]``: ``ref_argmax_rows(x, bitmask)`` for f32/f16/bf16 ``x [R, V]`` whose rows are contiguous
    (the row stride may exceed V). ``out`` may also be int32 (a decode graph writes the next step's
    input ids that way). ``mirror`` (pinned host memory when ``x`` is on a GPU, int32 or int64
    ``[R]``) receives the same indices, so the host can read them without a copy after the kernel.
    Reads nothing back to the host, so it can be captured in a CUDA graph once the shape has run
    eagerly (the first launch sizes the shared counters). ``chunk`` (elements per program; tests
    force small ones) defaults to ``argmax_chunk``'s choice."""
    kernel = "argmax_rows"
    require(x.dim() == 2 and x.shape[1] > 0, kernel, lambda: f"x must be [R, V] with V > 0, got {tuple(x.shape)}")
    require_float(kernel, "x", x)
    require_unit_last_stride(kernel, "x", x)
    rows, vocab = x.shape
    # Indices are packed into 31 bits.
    require(vocab < 2 ** 31, kernel, lambda: f"rows of {vocab} elements exceed the kernel's 2^31 - 1")
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=x.device)
    require(out.dtype in (torch.int64, torch.int32) and out.shape == (rows,) and out.stride(0) == 1, kernel,
            lambda: f"out must be contiguous int64 or int32 [{rows}], got {out.dtype} {tuple(out.shape)} strides {out.stride()}")
    if bitmask is not None:
        width = bitmask_width(vocab)
        require(bitmask.dtype == torch.int32 and bitmask.shape == (rows, width) and bitmask.stride(1) == 1, kernel,
                lambda: f"bitmask must be int32 [{rows}, {width}] with contiguous rows, got {bitmask.dtype} "
                f"{tuple(bitmask.shape)} strides {bitmask.stride()}")
    require_device(kernel, x, out, *([bitmask] if bitmask is not None else []))
    if mirror is not None:
        require(mirror.dtype in (torch.int64, torch.int32) and mirror.shape == (rows,) and mirror.stride(0) == 1
                and mirror.device.type == "cpu" and (mirror.is_pinned() or not x.is_cuda), kernel,
                lambda: f"mirror must be contiguous int64 or int32 [{rows}] in pinned host memory, got {mirror.dtype} "
                f"{tuple(mirror.shape)} on {mirror.device}{'' if mirror.is_pinned() else ' (not pinned)'}")
    if rows == 0:
        return out
    if chunk is None:
        chunk = argmax_chunk(rows, vocab, sm_count(x), config)
    num_chunks = triton.cdiv(vocab, chunk)
    if num_chunks > 1:
        partials = torch.empty(rows * num_chunks, dtype=torch.int64, device=x.device)
        counters = semaphore_counters(x.device, rows)
    else:
        # Never touched with one chunk (the program writes `out` directly); any tensor will do.
        partials = counters = out
    mask = bitmask if bitmask is not None else out  # never read without MASKED; any tensor will do
    _argmax_kernel[(rows, num_chunks)](
        x, mask, out, mirror if mirror is not None else out, partials, counters, vocab, x.stride(0), mask.stride(0),
        chunk, num_chunks, MASKED=bitmask is not None, MIRROR=mirror is not None, SPLIT=num_chunks > 1,
        BLOCK=min(config.argmax_block, pow2(chunk)), MERGE=config.argmax_merge_block, num_warps=4,
        **pdl_launch(x, config.pdl))
    return out


register_impl("argmax_rows", "torch", ref_argmax_rows)
register_impl("argmax_rows", "triton", triton_argmax_rows, priority=10, wants_config=True)
