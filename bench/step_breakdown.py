"""Where a decode step's time goes: the captured graph's replay alone against the whole engine step
(scheduling, staging inputs, replay, reading tokens back), at batch 1.

    python bench/step_breakdown.py --shape smollm2-135m
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import random_model  # noqa: E402

from kiln.compiler.compile import compile_model  # noqa: E402
from kiln.compiler.options import CompileOptions  # noqa: E402
from kiln.runtime.engine_core import EngineCore, EngineOptions  # noqa: E402
from kiln.runtime.sampling import SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    _, source = random_model(args.shape, layers=args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        artifact = compile_model(source, Path(tmp) / "m.kiln", CompileOptions(
            dtype="bf16", backend="triton", max_batch_tokens=512, max_batch_size=1, max_seq_len=1024))
        core = EngineCore(str(artifact), EngineOptions(device="cuda", kv_cache_tokens=2048,
                                                       enable_prefix_cache=False, decode_buckets=(1,)))
    core.add_request("r", list(range(1, 129)), SamplingParams(temperature=0, max_new_tokens=args.steps + 50,
                                                              ignore_eos=True))
    for _ in range(10):
        core.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        core.step()
    torch.cuda.synchronize()
    step_ms = 1e3 * (time.perf_counter() - start) / args.steps
    graph = core.runner.decode_graphs._graphs[1]
    start = time.perf_counter()
    for _ in range(args.steps):
        graph.replay()
    torch.cuda.synchronize()
    replay_ms = 1e3 * (time.perf_counter() - start) / args.steps
    print(f"{args.shape}: engine step {step_ms:.3f} ms, graph replay alone {replay_ms:.3f} ms, "
          f"host share {step_ms - replay_ms:.3f} ms")


if __name__ == "__main__":
    main()
