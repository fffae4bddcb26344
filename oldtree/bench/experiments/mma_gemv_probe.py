"""The W8A8 GEMVs at a few rows, Llama-3-8B's four layer GEMMs with their fusions, through the
registry's linear ops: the kernels other GPUs run (``gemv_quantized_row`` at one row, the tl.dot GEMV
or ``_scaled_mm`` above) against ``gemv_mma``'s tensor-core GEMV under tiling variants, beside the bf16
GEMV. Replayed from CUDA graphs (as decode runs them), us a layer (the four GEMMs' sum) and the share
of the weight bytes' copy-rate roofline.

    python bench/experiments/mma_gemv_probe.py --rows 1 5 16 64 --methods fp8 w8a8_int8
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from kiln.ir.weights import SCHEMES
from kiln.kernels import KernelConfig, get_impl
from kiln.kernels.quantize import quantize

# name: (N, K, op) at Llama-3-8B's shapes.
SHAPES = {"qkv": (6144, 4096, "rmsnorm_linear"), "o": (4096, 4096, "linear_residual"),
          "gate_up": (28672, 4096, "rmsnorm_linear"), "down": (4096, 14336, "silu_mul_linear_residual")}
# The schemes by their compile names: (stored scheme, activation quantization).
SCHEME_ACT = {"fp8": ("fp8_channel", "fp8_per_token"), "w8a8_int8": ("int8_channel", "int8_per_token")}
EPS = 1e-5


def timed_us(fn, reps: int = 50, graph: bool = True) -> float:
    """Mean GPU time of ``fn``; with ``graph`` replayed from a CUDA graph of ``reps`` calls, as decode
    runs them (eager calls of these small GEMMs time the host's launches, not the GPU)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    run = fn
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            for _ in range(reps):
                fn()
        run = captured.replay
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    run()
    torch.cuda.synchronize()
    start.record()
    for _ in range(1 if graph else reps):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def copy_rate() -> float:
    """Bytes a second of a device-to-device copy of 1 GiB (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (timed_us(lambda: dst.copy_(src), reps=10, graph=False) * 1e-6)


def layer_calls(method: str, rows: int):
    """(calls, weight bytes): a callable a GEMM taking a KernelConfig (None: the bf16 weights under the
    default config), for one layer."""
    scheme_name, act_quant = SCHEME_ACT[method]
    calls, weight_bytes = [], 0
    for n, k, op in SHAPES.values():
        dense = torch.randn(n, k, device="cuda") * k ** -0.5
        bf16 = dense.to(torch.bfloat16)
        stored, scales = quantize(dense, SCHEMES[scheme_name])
        stored, scales = stored.cuda(), tuple(s.cuda() for s in scales)
        weight_bytes += sum(t.numel() * t.element_size() for t in (stored, *scales))
        x = torch.randn(rows, 2 * k if op == "silu_mul_linear_residual" else k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
        norm = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
        residual = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)

        def call(config, op=op, x=x, norm=norm, stored=stored, scales=scales, bf16=bf16, out=out, residual=residual):
            weight = bf16 if config is None else stored
            args = {"rmsnorm_linear": (x, norm, weight, None), "linear_residual": (x, weight, residual),
                    "silu_mul_linear_residual": (x, weight, residual)}[op]
            kwargs = dict(eps=EPS) if op == "rmsnorm_linear" else {}
            if config is None:
                get_impl(f"triton.{op}").fn(*args, out=out, **kwargs)
            else:
                get_impl(f"triton.{op}.{scheme_name}").fn(*args, out=out, weight_scales=scales,
                                                          act_quant=act_quant, config=config, **kwargs)
        calls.append(call)
    return calls, weight_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 16])
    parser.add_argument("--methods", nargs="+", default=list(SCHEME_ACT), choices=list(SCHEME_ACT))
    parser.add_argument("--block-k", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--stages", type=int, nargs="+", default=[3, 4, 6])
    parser.add_argument("--quantizes", type=int, nargs="+", default=[0, 1],
                        help="mma_gemv_quantizes variants: 0, x quantized by a launch before; 1, in the GEMV")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON: per method and row count, the default's and each variant's us a layer")
    args = parser.parse_args()
    torch.manual_seed(0)
    results = []
    rate = copy_rate()
    print(f"copy rate {rate / 1e12:.2f} TB/s")
    print("| method | rows | bf16 GEMV us | without gemv_mma us | MMA GEMV best us (block_k, stages) | "
          "MMA share of roofline | all MMA variants |")
    print("|---|---:|---:|---:|---|---:|---|")
    for method, rows in itertools.product(args.methods, args.rows):
        calls, weight_bytes = layer_calls(method, rows)

        def layer(config):
            return lambda: [call(config) for call in calls]

        bf16 = timed_us(layer(None))
        default = timed_us(layer(KernelConfig(mma_gemv_max_rows=0)))
        results += [dict(method=method, rows=rows, us=bf16, bf16=True), dict(method=method, rows=rows, us=default)]
        variants = []
        for block_k, stages, quantizes in itertools.product(args.block_k, args.stages, args.quantizes):
            config = KernelConfig(mma_gemv_max_rows=64, mma_gemv_block_k=block_k,
                                  mma_gemv_num_stages=stages, mma_gemv_quantizes=bool(quantizes))
            try:
                variants.append((timed_us(layer(config)), f"{block_k}, {stages}, {quantizes}"))
                results.append(dict(method=method, rows=rows, us=variants[-1][0], mma_gemv_block_k=block_k,
                                    mma_gemv_num_stages=stages, mma_gemv_quantizes=bool(quantizes)))
            except Exception as error:  # a variant past shared memory fails to launch: say so, go on
                print(f"  {method} rows {rows} block_k {block_k} stages {stages}: "
                      f"{type(error).__name__}: {str(error)[:120]}")
        best, tiles = min(variants)
        roofline_us = weight_bytes / rate * 1e6
        print(f"| {method} | {rows} | {bf16:.1f} | {default:.1f} | {best:.1f} ({tiles}) | "
              f"{roofline_us / best:.0%} | {'; '.join(f'{us:.1f} ({t})' for us, t in variants)} |", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
