"""Where a weight-only quantized GEMM of many rows spends its time: the dequantizer
(``gemm_quantized.dequantize_weight``) alone, the whole ``library_gemm`` dequantizing path, and the
bf16 GEMM on the same shape, at Llama-3-8B's four layer GEMMs, with CUDA events over warm calls.

    python bench/experiments/dequant_probe.py --rows 64 --schemes mxfp4 int8_channel
"""

from __future__ import annotations

import argparse

import torch

from kiln.ir.weights import SCHEMES
from kiln.kernels.gemm_quantized import DEQUANTIZED, dequantize_weight, library_gemm
from kiln.kernels.quantize import quantize

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def timed_us(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--schemes", nargs="+", default=["mxfp4", "int8_channel"])
    args = parser.parse_args()
    print("| scheme | GEMM | dequantize us | bf16 write GB/s | dequantized GEMM us | bf16 GEMM us |")
    print("|---|---|---:|---:|---:|---:|")
    for scheme_name in args.schemes:
        scheme = SCHEMES[scheme_name]
        for name, (n, k) in SHAPES.items():
            dense = torch.randn(n, k, device="cuda") * k ** -0.5
            stored, (scale,) = quantize(dense, scheme)
            stored, scale = stored.cuda(), scale.cuda()
            x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(args.rows, n, device="cuda", dtype=torch.bfloat16)
            bf16 = dense.to(torch.bfloat16)
            dequant = timed_us(lambda: dequantize_weight(stored, scale, scheme, torch.bfloat16))
            gemm = timed_us(lambda: library_gemm(DEQUANTIZED, x, stored, scale, out, scheme=scheme, act_quant=None))
            plain = timed_us(lambda: torch.matmul(x, bf16.t(), out=out))
            print(f"| {scheme_name} | {name} | {dequant:.1f} | {n * k * 2 / dequant / 1e3:.0f} | {gemm:.1f} | {plain:.1f} |")


if __name__ == "__main__":
    main()
