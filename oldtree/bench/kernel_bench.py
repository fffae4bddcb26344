"""Kernel benchmark: each Triton kernel against its torch reference at Llama-3-8B shapes, on the GPU.

The fused decode GEMVs (``linear_fused``) run at Llama-3-8B and SmolLM2-135M shapes against the
composition they replace (Triton rmsnorm, cuBLAS, Triton silu_mul; cuBLAS addmm for the residual);
their quantized versions (``--only "(fp8)"``, ``(mxfp4)``, ...) at Llama-3-8B's layer shapes against
the torch references.
The row-wise argmax (greedy decode's token pick) runs on f32 logits of SmolLM2's and Llama 3's
vocabularies against ``torch.argmax``; the sampler (temperature, top-k, top-p, min-p, Gumbel draw)
against its sorting torch reference; the grammar-masked argmax against the clone + mask + argmax
it replaced.

Every case is timed with ``triton.testing.do_bench`` (median; eager calls, launch overhead included),
and the Triton launcher also with ``do_bench_cudagraph`` (replayed in a CUDA graph, as decode runs in
kiln; the torch references sync with the host and cannot be captured). Achieved bandwidth counts the bytes
that must move at the least: each input read once, each output written once. The ceiling is a large
device-to-device copy timed in the same run (bytes read + bytes written over its time), so the
"% of copy" column says how close a kernel comes to what the memory system delivers. Attention also
reports TFLOP/s (QK^T and PV, causal pairs only): prefill is compute-bound.

Usage: ``python bench/kernel_bench.py [--quick] [--kernel-config NAME=VALUE ...]``; from code,
``run(quick)`` returns the markdown table. ``--kernel-config`` sets ``KernelConfig`` fields for every
launcher timed.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from kiln.cli_compile import add_tuning_options, tuning_options
from kiln.kernels.config import DEFAULTS, KernelConfig

# Llama-3-8B: hidden 4096, 32 query heads, 8 KV heads of 128, MLP 14336, rope theta 500000.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 4096, 32, 8, 128, 14336
PAGE_SIZE = 16
DTYPE = torch.bfloat16


@dataclass
class Case:
    kernel: str
    shape: str
    bytes_moved: int
    triton_fn: Callable[[], object]
    torch_fn: Callable[[], object]
    # Runs both once and returns the largest absolute difference of their results.
    check: Callable[[], float]
    flops: int = 0


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _compare(triton_fn: Callable[[], object], out: torch.Tensor, torch_fn: Callable[[], object]) -> Callable[[], float]:
    """A check for kernels that write ``out``; a reference returning a tuple is compared on its first item."""

    def check() -> float:
        triton_fn()
        want = torch_fn()
        want = want[0] if isinstance(want, tuple) else want
        return (out.float() - want.float()).abs().max().item()

    return check


def _norm_cases(tokens_list: list[int], config: KernelConfig) -> list[Case]:
    from kiln.kernels.norm import ref_add_rmsnorm, ref_rmsnorm, triton_add_rmsnorm, triton_rmsnorm

    cases = []
    for tokens in tokens_list:
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=DTYPE)
        res = torch.randn_like(x)
        w = torch.randn(HIDDEN, device="cuda", dtype=DTYPE)
        out, summed = torch.empty_like(x), torch.empty_like(x)
        norm = partial(triton_rmsnorm, x, w, out=out, eps=1e-5, config=config)
        norm_ref = partial(ref_rmsnorm, x, w, 1e-5)
        cases.append(Case("rmsnorm", f"[{tokens}, {HIDDEN}]", _nbytes(x, w, out), norm, norm_ref,
                          _compare(norm, out, norm_ref)))
        fused = partial(triton_add_rmsnorm, x, res, w, out=(out, summed), eps=1e-5, config=config)
        fused_ref = partial(ref_add_rmsnorm, x, res, w, 1e-5)
        cases.append(Case("add_rmsnorm", f"[{tokens}, {HIDDEN}]", _nbytes(x, res, w, out, summed), fused, fused_ref,
                          _compare(fused, out, fused_ref)))
    return cases


def _silu_mul_cases(tokens_list: list[int], config: KernelConfig) -> list[Case]:
    from kiln.kernels.elementwise import ref_silu_mul, triton_silu_mul

    cases = []
    for tokens in tokens_list:
        fused = torch.randn(tokens, 2 * INTERMEDIATE, device="cuda", dtype=DTYPE)
        gate, up = torch.split(fused, [INTERMEDIATE, INTERMEDIATE], dim=-1)
        out = torch.empty(tokens, INTERMEDIATE, device="cuda", dtype=DTYPE)
        fn, ref = partial(triton_silu_mul, gate, up, out=out, config=config), partial(ref_silu_mul, gate, up)
        cases.append(Case("silu_mul", f"[{tokens}, {INTERMEDIATE}]", _nbytes(fused, out), fn, ref,
                          _compare(fn, out, ref)))
    return cases


def _rope_cases(tokens_list: list[int], config: KernelConfig) -> list[Case]:
    from kiln.kernels.rope import ref_rope, triton_rope

    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, device="cuda", dtype=torch.float32) / HEAD_DIM))
    angles = torch.arange(8192, device="cuda", dtype=torch.float32)[:, None] * inv_freq[None, :]
    table = torch.cat([angles.cos(), angles.sin()], dim=1)
    cases = []
    for tokens in tokens_list:
        qkv = torch.randn(tokens, HEADS + 2 * KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        q = qkv[:, :HEADS]
        positions = torch.randint(0, 8192, (tokens,), device="cuda", dtype=torch.int32)
        out = torch.empty(tokens, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        # q read, out written, each token's table row read once.
        moved = 2 * _nbytes(out) + _nbytes(positions) + tokens * HEAD_DIM * 4
        fn = partial(triton_rope, q, positions, table, out=out, config=config)
        ref = partial(ref_rope, q, positions, table)
        cases.append(Case("rope", f"q [{tokens}, {HEADS}, {HEAD_DIM}]", moved, fn, ref, _compare(fn, out, ref)))
    return cases


def _kv_store_cases(tokens_list: list[int], config: KernelConfig) -> list[Case]:
    from kiln.kernels.kv_store import ref_kv_store, triton_kv_store

    cases = []
    slots_total = 1 << 18
    k_cache = torch.zeros(slots_total, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v_cache = torch.zeros_like(k_cache)
    for tokens in tokens_list:
        qkv = torch.randn(tokens, HEADS + 2 * KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        k, v = qkv[:, HEADS:HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS:]
        slots = torch.randperm(slots_total, device="cuda")[:tokens].int()
        # k and v read, the same bytes written, the slots read.
        moved = 2 * _nbytes(k, v) + _nbytes(slots)
        fn = partial(triton_kv_store, k_cache, v_cache, k, v, slots, config=config)

        def check(fn=fn, k=k, v=v, slots=slots) -> float:
            k_cache.zero_()
            v_cache.zero_()
            fn()
            index = slots.long()
            return max((k_cache[index] - k).abs().max().item(), (v_cache[index] - v).abs().max().item())

        cases.append(Case("kv_store", f"k, v [{tokens}, {KV_HEADS}, {HEAD_DIM}]", moved, fn,
                          partial(ref_kv_store, k_cache, v_cache, k, v, slots), check))
    return cases


def _attention_case(q_lens: list[int], kv_lens: list[int], label: str, config: KernelConfig) -> Case:
    from kiln.kernels.attention import ref_paged_attention, triton_paged_attention

    batch = len(q_lens)
    pages = [-(-n // PAGE_SIZE) for n in kv_lens]
    # Pages handed out shuffled, as a long-running pool's would be; page 0 stays unused.
    order = torch.randperm(sum(pages), device="cuda").int() + 1
    table = torch.zeros(batch, max(pages), device="cuda", dtype=torch.int32)
    used = 0
    for b, count in enumerate(pages):
        table[b, :count] = order[used:used + count]
        used += count
    slots = (sum(pages) + 1) * PAGE_SIZE
    k_cache = torch.randn(slots, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    tokens = sum(q_lens)
    q = torch.randn(tokens, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)
    starts = [sum(q_lens[:b]) for b in range(batch)]
    q_start, q_len, kv_len = (torch.tensor(v, device="cuda", dtype=torch.int32) for v in (starts, q_lens, kv_lens))
    inputs = (q, k_cache, v_cache, q_start, q_len, kv_len, table)
    attrs = dict(scale=HEAD_DIM ** -0.5, page_size=PAGE_SIZE)
    sizes = {"T": tokens, "B": batch, "max_q_len": max(q_lens), "max_kv_len": max(kv_lens)}
    # Each sequence's K and V read once, q read, out written, the step's index tensors read.
    kv_bytes = 2 * sum(kv_lens) * KV_HEADS * HEAD_DIM * k_cache.element_size()
    moved = kv_bytes + 2 * _nbytes(q) + _nbytes(table, q_start, q_len, kv_len)
    # Causal (query, key) pairs; per pair and head, QK^T and PV take 2 * head_dim flops each.
    pairs = sum(n * (k - n) + n * (n + 1) // 2 for n, k in zip(q_lens, kv_lens))
    fn = partial(triton_paged_attention, *inputs, out=out, sizes=sizes, config=config, **attrs)
    ref = partial(ref_paged_attention, *inputs, **attrs)
    return Case("paged_attention", label, moved, fn, ref, _compare(fn, out, ref), flops=4 * pairs * HEADS * HEAD_DIM)


def _attention_cases(quick: bool, config: KernelConfig) -> list[Case]:
    cases = []
    decode = [(8, 4096)] if quick else [(b, ctx) for b in (1, 8, 64) for ctx in (1024, 4096)]
    for batch, ctx in decode:
        cases.append(_attention_case([1] * batch, [ctx] * batch, f"decode B={batch} ctx={ctx}", config))
    extend = [(1, 2048)] if quick else [(1, 2048), (8, 512)]
    for batch, length in extend:
        cases.append(_attention_case([length] * batch, [length] * batch, f"prefill {batch}x{length}", config))
    return cases


# The GEMMs of one decoder layer and the LM head: (model, GEMM, fused op, out features N, in features K).
FUSED_GEMMS = [
    ("llama3-8b", "qkv", "rmsnorm_linear", HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN),
    ("llama3-8b", "o", "linear_residual", HIDDEN, HIDDEN),
    ("llama3-8b", "gate_up", "rmsnorm_linear", 2 * INTERMEDIATE, HIDDEN),
    ("llama3-8b", "down", "silu_mul_linear_residual", HIDDEN, INTERMEDIATE),
    ("llama3-8b", "lm_head", "rmsnorm_linear", 128256, HIDDEN),
    ("smollm2-135m", "qkv", "rmsnorm_linear", 960, 576),
    ("smollm2-135m", "o", "linear_residual", 576, 576),
    ("smollm2-135m", "gate_up", "rmsnorm_linear", 3072, 576),
    ("smollm2-135m", "down", "silu_mul_linear_residual", 576, 1536),
    ("smollm2-135m", "lm_head", "rmsnorm_linear", 49152, 576),
]


def _linear_fused_case(op: str, label: str, weight: torch.Tensor, tokens: int, config: KernelConfig) -> Case:
    from kiln.kernels import linear_fused as lf

    n, k = weight.shape
    # silu_mul_linear_residual's input holds gate and up side by side.
    x = torch.randn(tokens, 2 * k if op == "silu_mul_linear_residual" else k, device="cuda", dtype=DTYPE)
    norm_weight = torch.randn(k, device="cuda", dtype=DTYPE)
    residual = torch.randn(tokens, n, device="cuda", dtype=DTYPE)
    out, want = (torch.empty(tokens, n, device="cuda", dtype=DTYPE) for _ in range(2))
    if op == "rmsnorm_linear":
        fused = partial(lf.triton_rmsnorm_linear, x, norm_weight, weight, out=out, eps=1e-5, config=config)
        composed = partial(lf.composed_rmsnorm_linear, x, norm_weight, weight, out=want, eps=1e-5, config=config)
        inputs = (x, norm_weight, weight)
    else:
        fused_fn, composed_fn = ((lf.triton_linear_residual, lf.composed_linear_residual) if op == "linear_residual"
                                 else (lf.triton_silu_mul_linear_residual, lf.composed_silu_mul_linear_residual))
        fused = partial(fused_fn, x, weight, residual, out=out, config=config)
        composed = partial(composed_fn, x, weight, residual, out=want)
        inputs = (x, weight, residual)

    def reference() -> torch.Tensor:
        composed()
        return want

    return Case(f"{op} (gemv)", f"{label} T={tokens} [{n}, {k}]", _nbytes(*inputs, out), fused, reference,
                _compare(fused, out, reference))


def _linear_fused_cases(quick: bool, config: KernelConfig) -> list[Case]:
    from kiln.kernels.gemv import GEMV_MAX_ROWS

    # The (gemv) rows time the GEMV at every shape, whatever weight size the engine gives it.
    config = config.with_settings({"gemv_max_weight_bytes": 1 << 62, "gemv_one_row_max_weight_bytes": 1 << 62})
    # Decode's batch sizes; GEMV_MAX_ROWS (the tl.dot path at its largest) shows where cuBLAS should take over.
    tokens_list = [1] if quick else [1, 8, GEMV_MAX_ROWS]
    cases = []
    for model, gemm, op, n, k in FUSED_GEMMS:
        weight = torch.randn(n, k, device="cuda", dtype=DTYPE) * k ** -0.5
        cases += [_linear_fused_case(op, f"{model} {gemm}", weight, tokens, config) for tokens in tokens_list]
    return cases


def _quantized_gemm_cases(quick: bool, config: KernelConfig) -> list[Case]:
    """Llama-3-8B's layer GEMMs on quantized weights (``linear_quantized_triton``: the quantized GEMV at
    decode's rows, the library GEMMs past them) against their torch references (dequantize, then the
    plain op); bytes moved count the stored weights and their scales."""
    from kiln.compiler.quantization import METHODS
    from kiln.kernels import get_impl
    from kiln.kernels.quantize import quantize

    tokens_list = [1] if quick else [1, 16, 64]
    cases = []
    for method in METHODS.values():
        for _, gemm, op, n, k in (g for g in FUSED_GEMMS if g[0] == "llama3-8b" and g[1] != "lm_head"):
            stored, scales = quantize(torch.randn(n, k, device="cuda") * k ** -0.5, method.scheme)
            for tokens in tokens_list:
                x = torch.randn(tokens, 2 * k if op == "silu_mul_linear_residual" else k, device="cuda", dtype=DTYPE)
                residual = torch.randn(tokens, n, device="cuda", dtype=DTYPE)
                args = ((x, torch.randn(k, device="cuda", dtype=DTYPE), stored, None) if op == "rmsnorm_linear"
                        else (x, stored, residual))
                kwargs = dict(weight_scales=scales, act_quant=method.act_quant)
                if op == "rmsnorm_linear":
                    kwargs["eps"] = 1e-5
                out, want = (torch.empty(tokens, n, device="cuda", dtype=DTYPE) for _ in range(2))
                fast = partial(get_impl(f"triton.{op}.{method.scheme}").fn, *args, out=out, config=config, **kwargs)
                slow = partial(get_impl(f"torch.{op}.{method.scheme}").fn, *args, out=want, **kwargs)

                def reference(slow=slow, want=want) -> torch.Tensor:
                    slow()
                    return want

                moved = _nbytes(*(a for a in args if a is not None), *scales, out)
                cases.append(Case(f"{op} ({method.name})", f"llama3-8b {gemm} T={tokens} [{n}, {k}]", moved, fast,
                                  reference, _compare(fast, out, reference)))
    return cases


def _argmax_cases(quick: bool, config: KernelConfig) -> list[Case]:
    from kiln.kernels.argmax import ref_argmax_rows, triton_argmax_rows

    # Greedy decode's argmax over f32 logits: SmolLM2's and Llama 3's vocabularies, batch 1 to 256.
    shapes = [(1, 49152), (1, 128256), (64, 128256)] + ([] if quick else [(256, 128256)])
    cases = []
    for rows, vocab in shapes:
        x = torch.randn(rows, vocab, device="cuda", dtype=torch.float32)
        out = torch.empty(rows, device="cuda", dtype=torch.int64)
        fn, ref = partial(triton_argmax_rows, x, out, config=config), partial(ref_argmax_rows, x)
        cases.append(Case("argmax", f"[{rows}, {vocab}] f32", _nbytes(x, out), fn, ref, _compare(fn, out, ref)))
    return cases


def _sample_cases(quick: bool, config: KernelConfig) -> list[Case]:
    from kiln.kernels.argmax import ref_argmax_rows, triton_argmax_rows
    from kiln.kernels.bitmask import bitmask_width, triton_apply_bitmask
    from kiln.kernels.sample import ref_sample_rows, triton_sample_rows

    # Sampled decode's token pick (temperature 0.7, top-k 50, top-p 0.9, min-p 0.05; the reference
    # sorts the vocabulary) and the grammar-masked argmax, over f32 logits.
    shapes = [(1, 49152), (64, 128256)] + ([] if quick else [(1, 128256), (64, 49152)])
    cases = []
    for rows, vocab in shapes:
        x = torch.randn(rows, vocab, device="cuda", dtype=torch.float32) * 3
        params = (torch.full((rows,), 0.7, device="cuda"), torch.full((rows,), 50, device="cuda"),
                  torch.full((rows,), 0.9, device="cuda"), torch.full((rows,), 0.05, device="cuda"),
                  torch.arange(rows, device="cuda"), torch.zeros(rows, dtype=torch.int64, device="cuda"), True, True,
                  True)
        out = torch.empty(rows, device="cuda", dtype=torch.int64)
        fn = partial(triton_sample_rows, x, *params, out=out, config=config)
        ref = partial(ref_sample_rows, x, *params)
        cases.append(Case("sample (top-k/p, min-p)", f"[{rows}, {vocab}] f32", _nbytes(x, out), fn, ref,
                          _compare(fn, out, ref)))
    for rows, vocab in shapes[:2]:
        x = torch.randn(rows, vocab, device="cuda", dtype=torch.float32)
        mask = torch.randint(-2 ** 31, 2 ** 31, (rows, bitmask_width(vocab)), device="cuda", dtype=torch.int64)
        mask = mask.to(torch.int32)
        out = torch.empty(rows, device="cuda", dtype=torch.int64)

        def unfused(x=x, mask=mask) -> torch.Tensor:  # what masked_argmax did before: copy, mask, argmax
            scores = x.clone()
            triton_apply_bitmask(scores, mask, config=config)
            return triton_argmax_rows(scores, config=config)

        fn = partial(triton_argmax_rows, x, out, bitmask=mask, config=config)
        cases.append(Case("masked argmax (vs clone+mask+argmax)", f"[{rows}, {vocab}] f32", _nbytes(x, mask, out), fn,
                          unfused, _compare(fn, out, partial(ref_argmax_rows, x, mask))))
    return cases


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes per second of a large device-to-device copy, counting the read and the write."""
    import triton.testing

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * nbytes / (ms * 1e-3)


def run(quick: bool = False, log: Callable[[str], None] = print, only: str | None = None,
        config: KernelConfig = DEFAULTS) -> str:
    """Benchmarks every kernel (with ``only``, those whose name contains it) under ``config`` and
    returns (and logs line by line) a markdown table."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench/kernel_bench.py needs a CUDA GPU: it times compiled Triton kernels")
    import triton.testing

    tokens = [64] if quick else [64, 4096]
    rep = 50 if quick else 200
    ceiling = copy_bandwidth()
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    lines = [
        f"GPU: {torch.cuda.get_device_name()}; copy ceiling {ceiling / 1e9:.0f} GB/s; dtype {DTYPE}; "
        f"kernel config changes: {config.changes() or 'none'}",
        "",
        "| kernel | shape | triton µs (graph) | triton µs (eager) | torch µs (eager) | speedup | GB/s | % of copy "
        "| TFLOP/s | max abs err |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for line in lines:
        log(line)
    builders = [lambda: _norm_cases(tokens, config), lambda: _silu_mul_cases(tokens, config),
                lambda: _rope_cases(tokens, config), lambda: _kv_store_cases(tokens, config),
                lambda: _attention_cases(quick, config), lambda: _linear_fused_cases(quick, config),
                lambda: _quantized_gemm_cases(quick, config),
                lambda: _argmax_cases(quick, config), lambda: _sample_cases(quick, config)]
    for build in builders:
        for case in build():
            if only is not None and only not in case.kernel:
                continue
            err = case.check()
            graph_ms = triton.testing.do_bench_cudagraph(case.triton_fn, rep=rep, return_mode="median")
            eager_ms = triton.testing.do_bench(case.triton_fn, rep=rep, return_mode="median")
            torch_ms = triton.testing.do_bench(case.torch_fn, rep=rep, return_mode="median")
            gbs = case.bytes_moved / (graph_ms * 1e-3) / 1e9
            tflops = f"{case.flops / (graph_ms * 1e-3) / 1e12:.0f}" if case.flops else ""
            # Graph replays reuse the same inputs, so data smaller than L2 is served from it.
            in_l2 = " (L2)" if case.bytes_moved < l2_bytes else ""
            line = (f"| {case.kernel} | {case.shape} | {graph_ms * 1e3:.1f} | {eager_ms * 1e3:.1f} | "
                    f"{torch_ms * 1e3:.1f} | {torch_ms / eager_ms:.1f}x | {gbs:.0f}{in_l2} | "
                    f"{100 * gbs * 1e9 / ceiling:.0f}% | {tflops} | {err:.3g} |")
            lines.append(line)
            log(line)
        torch.cuda.empty_cache()
    notes = [
        "",
        "graph: the Triton launcher replayed in a CUDA graph (how decode runs); eager: called from Python, launch "
        "overhead included; speedup is eager over eager. GB/s counts each input read once and each output written "
        "once, over the graph time; (L2): the data fits in L2 and stays there across replays. For the (gemv) rows the "
        "torch column is the composition the fused op replaces (Triton rmsnorm and silu_mul, cuBLAS).",
    ]
    for line in notes:
        log(line)
    lines += notes
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    parser.add_argument("--only", default=None, metavar="TEXT", help="only kernels whose name contains TEXT")
    add_tuning_options(parser, skip_pass=False)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/kernel_bench.py needs a CUDA GPU: it times compiled Triton kernels against torch; none found.",
              file=sys.stderr)
        return 2
    run(args.quick, only=args.only, config=tuning_options(args)["kernel_config"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
