"""Where a quantized GEMM of many rows (a large decode batch) spends its time, at Llama-3-8B's four layer
GEMMs with their fusions (RMSNorm before qkv and gate/up, the residual after o and down, SiLU·mul
before down), with CUDA events over warm calls:

- the bf16 GEMM as decode runs it above 16 rows (the norm or SiLU·mul kernel, then cuBLAS);
- a weight-only scheme's dequantizing path (``gemm_quantized.library_gemm``: the weight dequantized
  to bf16, then the same cuBLAS composition) and its dequantizer alone;
- the quantized GEMV's many-row tiles (``gemv_quantized``, weights decoded in registers for tl.dot)
  under each tiling variant, with the prologue fused ("fused") and applied by its own kernel first
  ("composed", the GEMV reading x as it is);
- W8A8 fp8 through ``torch._scaled_mm`` with the activation quantizer.

    python bench/experiments/dequant_probe.py --rows 64 --schemes mxfp4 int8_channel
"""

from __future__ import annotations

import argparse
import itertools

import torch

from kiln.ir.weights import SCHEMES
from kiln.kernels.config import KernelConfig
from kiln.kernels.elementwise import triton_silu_mul
from kiln.kernels.gemm_quantized import DEQUANTIZED, SCALED_MM, dequantize_weight, library_gemm
from kiln.kernels.gemv_quantized import launch_quantized_gemv
from kiln.kernels.linear_fused import composed_linear_residual, composed_rmsnorm_linear, \
    composed_silu_mul_linear_residual
from kiln.kernels.norm import triton_rmsnorm
from kiln.kernels.quantize import quantize

# name: (N, K, fusion) at Llama-3-8B's shapes.
SHAPES = {"qkv": (6144, 4096, "norm"), "o": (4096, 4096, "residual"), "gate_up": (28672, 4096, "norm"),
          "down": (4096, 14336, "silu_mul")}
EPS = 1e-5


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


def variants(args) -> list[KernelConfig]:
    return [KernelConfig(quantized_gemv_block_t=t, quantized_gemm_block_n=n, quantized_gemm_block_k=k,
                         quantized_gemm_num_warps=w, quantized_gemm_num_stages=stages)
            for t, n, k, w, stages in itertools.product(args.block_t, args.block_n, args.block_k, args.warps,
                                                        args.stages)]


def label(config: KernelConfig) -> str:
    return (f"t{config.quantized_gemv_block_t} n{config.quantized_gemm_block_n} k{config.quantized_gemm_block_k} "
            f"w{config.quantized_gemm_num_warps} s{config.quantized_gemm_num_stages}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--schemes", nargs="+", default=["mxfp4", "int8_channel", "fp8_channel"])
    parser.add_argument("--block-t", type=int, nargs="+", default=[64])
    parser.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--block-k", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--top", type=int, default=3, help="fastest tiled variants listed per GEMM")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = args.rows
    print("| scheme | GEMM | bf16 cuBLAS us | dequantize us | dequantizing path us | fp8 _scaled_mm path us | "
          "tiled GEMV fused: best us (tiles) | tiled GEMV composed: best us (tiles) |")
    print("|---|---|---:|---:|---:|---:|---|---|")
    for scheme_name in args.schemes:
        scheme = SCHEMES[scheme_name]
        for name, (n, k, fusion) in SHAPES.items():
            dense = torch.randn(n, k, device="cuda") * k ** -0.5
            stored, (scale,) = quantize(dense, scheme)
            stored, scale = stored.cuda(), scale.cuda()
            bf16 = dense.to(torch.bfloat16)
            x = torch.randn(rows, 2 * k if fusion == "silu_mul" else k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
            norm_weight = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
            residual = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
            fused = {"norm": dict(norm_weight=norm_weight, eps=EPS), "residual": dict(residual=residual),
                     "silu_mul": dict(gated=True, residual=residual)}[fusion]
            prologue_out = torch.empty(rows, k, device="cuda", dtype=torch.bfloat16)

            def bf16_path():
                if fusion == "norm":
                    composed_rmsnorm_linear(x, norm_weight, bf16, out=out, eps=EPS)
                elif fusion == "residual":
                    composed_linear_residual(x, bf16, residual, out=out)
                else:
                    composed_silu_mul_linear_residual(x, bf16, residual, out=out)

            def composed(config):
                # The prologue by its own kernel, then the GEMV on x as it is (the epilogue fused).
                source = x
                if fusion == "norm":
                    triton_rmsnorm(x, norm_weight, out=prologue_out, eps=EPS)
                    source = prologue_out
                elif fusion == "silu_mul":
                    triton_silu_mul(*x.chunk(2, dim=-1), out=prologue_out)
                    source = prologue_out
                launch_quantized_gemv(source, stored, scale, out, scheme=scheme, act_quant=None,
                                      residual=fused.get("residual"), config=config)

            act_quant = "fp8_per_token" if scheme_name == "fp8_channel" else None
            plain = timed_us(bf16_path)
            dequant = path = scaled = float("nan")
            if act_quant is None:
                dequant = timed_us(lambda: dequantize_weight(stored, scale, scheme, torch.bfloat16))
                path = timed_us(lambda: library_gemm(DEQUANTIZED, x, stored, scale, out, scheme=scheme,
                                                     act_quant=None, **fused))
            else:
                scaled = timed_us(lambda: library_gemm(SCALED_MM, x, stored, scale, out, scheme=scheme,
                                                       act_quant=act_quant, **fused))
            tiled_fused, tiled_composed = [], []
            for config in variants(args):
                tiled_fused.append((timed_us(lambda: launch_quantized_gemv(
                    x, stored, scale, out, scheme=scheme, act_quant=act_quant, config=config, **fused)), label(config)))
                if act_quant is None:
                    tiled_composed.append((timed_us(lambda: composed(config)), label(config)))

            def best(results):
                return "; ".join(f"{us:.1f} ({tiles})" for us, tiles in sorted(results)[:args.top]) or "-"

            print(f"| {scheme_name} | {name} | {plain:.1f} | {dequant:.1f} | {path:.1f} | {scaled:.1f} | "
                  f"{best(tiled_fused)} | {best(tiled_composed)} |", flush=True)


if __name__ == "__main__":
    main()
