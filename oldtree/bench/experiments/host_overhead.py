"""The host's share of a decode step: the engine core's Python work per step, outside the model.

On a GPU the host prepares step N+1 while step N runs (overlapped scheduling), so the host's work
is hidden only while it takes less than the GPU's step: small models at large batches can become
host-bound. This measures that work on any machine: a one-layer SmolLM2-135M-shaped model with a
small vocabulary on the CPU (torch backend, decode steps through the padded graph path, overlapped
as on a GPU), greedy requests that never stop, and the engine step's time less the time inside the
model's step program, both in this process's CPU time (on a shared machine, wall time also counts
other processes' turns). (The CPU path's argmax runs outside the program, and on a GPU inside the
graph: the small vocabulary keeps it out of the figure.)

    python bench/experiments/host_overhead.py --batches 1 8 64 256
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

# The experiments beside this file first, then the benchmarks' helpers in bench/.
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from models import random_model  # noqa: E402

from kiln.compiler.compile import compile_model  # noqa: E402
from kiln.compiler.options import CompileOptions  # noqa: E402
from kiln.runtime.engine_core import EngineCore  # noqa: E402
from kiln.runtime.engine_options import EngineOptions  # noqa: E402
from kiln.runtime.sampling import SamplingParams  # noqa: E402

PROMPT_LEN = 8
MAX_SEQ_LEN = 1024


def host_ms_per_step(source, batch: int, steps: int, directory: Path) -> float:
    """The least over rounds of ``steps`` decode steps of one engine at ``batch`` running requests
    (other processes' interference only ever adds)."""
    artifact = compile_model(source, directory / f"b{batch}.kiln", CompileOptions(
        dtype="f32", backend="torch", max_batch_tokens=max(512, batch * PROMPT_LEN), max_batch_size=batch,
        max_seq_len=MAX_SEQ_LEN))
    core = EngineCore(str(artifact), EngineOptions(device="cpu", kv_cache_tokens=batch * MAX_SEQ_LEN,
                                                   enable_prefix_cache=False, decode_buckets=(batch,)))
    executor = core.runner.executor
    run_program, in_model = executor.run, [0.0]

    def timed_run(*args, **kwargs):
        start = time.process_time()
        try:
            return run_program(*args, **kwargs)
        finally:
            in_model[0] += time.process_time() - start

    executor.run = timed_run
    params = SamplingParams(temperature=0, max_new_tokens=MAX_SEQ_LEN - PROMPT_LEN, ignore_eos=True)
    for i in range(batch):
        core.add_request(f"r{i}", [1 + (i + j) % 1000 for j in range(PROMPT_LEN)], params)
    for _ in range(3):  # prefill, then decode steps reach the overlapped chain
        core.step()
    rounds = []
    for _ in range(5):
        in_model[0] = 0.0
        start = time.process_time()
        for _ in range(steps):
            core.step()
        rounds.append(1e3 * (time.process_time() - start - in_model[0]) / steps)
    assert core.overlapped_steps >= 5 * steps, "decode steps did not run overlapped"
    return min(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64, 256])
    parser.add_argument("--steps", type=int, default=20, help="decode steps in each of the 5 timed rounds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    _, source = random_model("smollm2-135m", dtype=torch.float32, layers=1, device="cpu", vocab_size=512)
    print("| batch | host ms a step | host us a request |")
    print("|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for batch in args.batches:
            ms = host_ms_per_step(source, batch, args.steps, Path(tmp))
            print(f"| {batch} | {ms:.3f} | {1e3 * ms / batch:.1f} |", flush=True)


if __name__ == "__main__":
    main()
