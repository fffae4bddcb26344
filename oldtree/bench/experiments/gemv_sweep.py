"""Decode GEMV tuning on the GPU: the fused Triton GEMV (``kiln/kernels/gemv.py``) against the cuBLAS
composition, per op and chained as decode runs a Llama-3-8B layer, under tiling variants.

    python bench/experiments/gemv_sweep.py --tokens 1 8 --variant "" --variant "gemv_block_k=(64,2048) gemv_num_warps=8"

A layer's GEMMs, each on its own weights (``--layers`` copies, so nothing is served from L2):
norm + qkv, o + residual, norm + gate/up + SiLU gate, down + residual. Each op is timed as a CUDA
graph of that op over every layer's weights; the chain as a graph of whole layers, where the output
of one op feeds the next (so programmatic dependent launch overlaps each GEMV with the one before).
A variant sets ``KernelConfig`` fields (``NAME=VALUE`` pairs separated by spaces, values as Python
literals without spaces, e.g. ``gemv_block_n=(4,4) gemv_product_elements=8192``) for its rows only;
a name that is no field is an error listing the fields. Each row's max abs error is against the
composition.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

# The experiments beside this file first, then the benchmarks' helpers in bench/.
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from kernel_bench import copy_bandwidth  # noqa: E402

from kiln.kernels import linear_fused as lf  # noqa: E402
from kiln.kernels.config import DEFAULTS, KernelConfig, KernelConfigError, parse_settings  # noqa: E402

HIDDEN, INTERMEDIATE, QKV = 4096, 14336, 6144  # Llama-3-8B
DTYPE = torch.bfloat16
EPS = 1e-5
OPS = ("qkv", "o", "gate_up", "down")


@dataclass
class Layer:
    norm1: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    norm2: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor

    def weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in (self.qkv, self.o, self.gate_up, self.down))


def random_layers(count: int) -> list[Layer]:
    def weight(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, device="cuda", dtype=DTYPE) * k ** -0.5

    def norm() -> torch.Tensor:
        return 1 + 0.1 * torch.randn(HIDDEN, device="cuda", dtype=DTYPE)

    return [Layer(norm(), weight(QKV, HIDDEN), weight(HIDDEN, HIDDEN), norm(), weight(2 * INTERMEDIATE, HIDDEN),
                  weight(HIDDEN, INTERMEDIATE)) for _ in range(count)]


class Activations:
    """The step's activations for ``tokens`` rows: residual stream, qkv, gate/up output."""

    def __init__(self, tokens: int) -> None:
        def buf(width: int) -> torch.Tensor:
            return torch.randn(tokens, width, device="cuda", dtype=DTYPE)

        self.h, self.h2, self.qkv, self.gate_up = buf(HIDDEN), buf(HIDDEN), buf(QKV), buf(2 * INTERMEDIATE)


def op_runner(op: str, layer: Layer, act: Activations, fused: bool, config: KernelConfig) -> Callable[[], None]:
    """One op of one layer, on the fused GEMV (``fused``) or the cuBLAS composition, its Triton
    kernels under ``config``. The attention output is stood in for by the first HIDDEN columns of
    qkv, so the chain keeps its dependencies."""
    if op == "qkv":
        fn = lf.triton_rmsnorm_linear if fused else lf.composed_rmsnorm_linear
        return lambda: fn(act.h, layer.norm1, layer.qkv, out=act.qkv, eps=EPS, config=config)
    if op == "o":
        if fused:
            return lambda: lf.triton_linear_residual(act.qkv[:, :HIDDEN], layer.o, act.h, out=act.h2, config=config)
        return lambda: lf.composed_linear_residual(act.qkv[:, :HIDDEN], layer.o, act.h, out=act.h2)
    if op == "gate_up":
        fn = lf.triton_rmsnorm_linear if fused else lf.composed_rmsnorm_linear
        return lambda: fn(act.h2, layer.norm2, layer.gate_up, out=act.gate_up, eps=EPS, config=config)
    fn = lf.triton_silu_mul_linear_residual if fused else lf.composed_silu_mul_linear_residual
    return lambda: fn(act.gate_up, layer.down, act.h2, out=act.h, config=config)


def graph_us(calls: list[Callable[[], None]], replays: int = 20) -> float:
    """Median GPU time of one replay of a graph of ``calls``, in microseconds."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # compile and warm up outside the capture
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / replays)
    return sorted(times)[len(times) // 2]


def max_error(op: str, layer: Layer, tokens: int, config: KernelConfig) -> float:
    """The fused op's largest deviation from the composition on the same inputs."""
    outputs = []
    for fused in (True, False):
        torch.manual_seed(0)
        act = Activations(tokens)
        op_runner(op, layer, act, fused, config)()
        outputs.append({"qkv": act.qkv, "o": act.h2, "gate_up": act.gate_up, "down": act.h}[op].float())
    return (outputs[0] - outputs[1]).abs().max().item()


# The fused ops take the GEMV for every weight size here, whatever the engine's bound.
ALWAYS_GEMV = {"gemv_max_weight_bytes": 1 << 62, "gemv_one_row_max_weight_bytes": 1 << 62}


def parse_variant(text: str) -> KernelConfig:
    """A ``--variant``: space-separated ``NAME=VALUE`` fields of ``KernelConfig`` ('' the defaults),
    with the GEMV taking every weight size."""
    return DEFAULTS.with_settings({**ALWAYS_GEMV, **parse_settings(text.split())})


def measure(label: str, fused: bool, layers: list[Layer], tokens: int, ceiling: float, config: KernelConfig) -> str:
    act = Activations(tokens)
    per_op = [graph_us([op_runner(op, layer, act, fused, config) for layer in layers]) / len(layers) for op in OPS]
    chain = graph_us([op_runner(op, layer, act, fused, config) for layer in layers for op in OPS]) / len(layers)
    roofline_us = layers[0].weight_bytes() / ceiling * 1e6
    error = max(max_error(op, layers[0], tokens, config) for op in OPS) if fused else 0.0
    cells = " | ".join(f"{us:.1f}" for us in per_op)
    return (f"| {label} | {tokens} | {cells} | {chain:.1f} | {100 * roofline_us / chain:.0f}% | {error:.3g} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--variant", action="append", default=None,
                        help="KernelConfig NAME=VALUE settings, space-separated ('' = the defaults)")
    args = parser.parse_args(argv)
    try:
        variants = {text: parse_variant(text) for text in args.variant or [""]}
    except KernelConfigError as exc:
        parser.error(f"--variant: {exc}")
    if not torch.cuda.is_available():
        print("bench/experiments/gemv_sweep.py needs a CUDA GPU.", file=sys.stderr)
        return 2
    ceiling = copy_bandwidth()
    layers = random_layers(args.layers)
    print(f"GPU: {torch.cuda.get_device_name()}; copy ceiling {ceiling / 1e9:.0f} GB/s; Llama-3-8B layer "
          f"{layers[0].weight_bytes() / 1e6:.0f} MB = {layers[0].weight_bytes() / ceiling * 1e6:.1f} us at the ceiling")
    print("\n| variant | T | qkv us | o us | gate_up us | down us | layer chain us | % of copy | max abs err |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for tokens in args.tokens:
        print(measure("cuBLAS composition", False, layers, tokens, ceiling, DEFAULTS), flush=True)
        for text, config in variants.items():
            print(measure(text or "gemv defaults", True, layers, tokens, ceiling, config), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
