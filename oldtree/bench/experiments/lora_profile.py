"""Where multi-LoRA decode time goes: the GPU time of each kernel in decode steps of a LoRA artifact,
serving the base model (slot -1 everywhere) and a batch spread over adapters.

    python bench/experiments/lora_profile.py --shape llama3-8b --layers 8 --batches 1 64
    python bench/experiments/lora_profile.py --layers 8 --kernel-config pdl=false

The table's "GPU busy" sums the kernels' durations: with programmatic dependent launch a kernel
starts while the one before it runs and waits inside itself, so its duration includes part of its
predecessor's; ``pdl=false`` gives durations that do not overlap.

Each section also gives the engine step's wall time (steps are graph replays, so this is the step's
GPU time plus its launch); ``bench/lora_decode.py`` gives them at full depth against a base artifact.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from lora_decode import write_adapter  # noqa: E402
from models import SHAPES, random_model  # noqa: E402
from step_breakdown import kernel_table, trace  # noqa: E402

from kiln.cli_compile import add_tuning_options, tuning_options  # noqa: E402
from kiln.compiler.compile import compile_model  # noqa: E402
from kiln.compiler.options import CompileOptions  # noqa: E402
from kiln.runtime.engine_core import EngineCore  # noqa: E402
from kiln.runtime.engine_options import EngineOptions  # noqa: E402
from kiln.runtime.sampling import SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=14)
    add_tuning_options(parser, skip_pass=False)  # --kernel-config NAME=VALUE, e.g. pdl=false: no launch overlap
    args = parser.parse_args()
    _, source = random_model(args.shape, dtype=torch.bfloat16, layers=args.layers, device="cuda")
    batch, seq_len = max(args.batches), 128 + args.steps + 64
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        artifact = compile_model(source, tmp / "lora.kiln", CompileOptions(
            dtype="bf16", backend="triton", max_batch_tokens=max(512, batch * 128), max_batch_size=batch,
            max_seq_len=seq_len, max_loras=args.adapters, max_lora_rank=args.rank,
            kernel_config=tuning_options(args)["kernel_config"]))
        core = EngineCore(str(artifact), EngineOptions(device="cuda", kv_cache_tokens=batch * seq_len + 1024,
                                                       enable_prefix_cache=False))
        names = [f"adapter{i}" for i in range(args.adapters)]
        for i, name in enumerate(names):
            core.load_lora(name, str(write_adapter(tmp / name, source.config, args.rank, seed=i)))
        params = SamplingParams(temperature=0, max_new_tokens=args.steps * 4 + 20, ignore_eos=True)
        for size in args.batches:
            for label, loras in (("base model", [None] * size),
                                 ("adapters", [names[i % len(names)] for i in range(size)])):
                for i, lora in enumerate(loras):
                    core.add_request(f"{label}-{size}-{i}", list(range(1 + i, 129 + i)), params, lora=lora)
                for _ in range(args.steps):  # prefill, graphs captured, decode running
                    core.step()
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(args.steps):
                    core.step()
                torch.cuda.synchronize()
                step_ms = 1e3 * (time.perf_counter() - start) / args.steps
                print(f"\n## batch {size}, {label} ({args.layers} layers): engine step {step_ms:.3f} ms")
                print(kernel_table(trace(core.step, args.steps), args.steps, args.top))
                while core.has_work():
                    core.step()


if __name__ == "__main__":
    main()
