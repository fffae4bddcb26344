"""Where a prefill's time goes: the whole engine call (requests in, first tokens out) against the GPU's
busy time in it, the host functions that take the rest, and the prefill's kernels one by one.

    python bench/experiments/prefill_breakdown.py --shape smollm2-135m --batch 1 --prompt-len 128 [--eager]

Run op by op (``--eager``), a small prefill's time is the host's: each kernel's launch costs Python
and driver time, and the GPU idles between launches; by default the step replays a prefill graph
(kiln/runtime/worker/prefill_graphs.py). The host table is cProfile's, sorted by own time, over the same
prefills; ``--kernel-config``/``--skip-pass`` as in bench/experiments/step_breakdown.py.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

# The experiments beside this file first, then the benchmarks' helpers in bench/.
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from models import add_model_arguments, random_engine  # noqa: E402
from step_breakdown import kernel_table, trace  # noqa: E402

from kiln.runtime.sampling import SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--eager", action="store_true", help="without prefill graphs (op by op)")
    args = parser.parse_args()
    core = random_engine(args, args.prompt_len + 16, decode_buckets=(), prefill_graphs=not args.eager)
    params = SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True)
    counter = iter(range(1 << 30))

    def prefill() -> None:
        for i in range(args.batch):
            core.add_request(f"r{next(counter)}", list(range(1 + i, args.prompt_len + 1 + i)), params)
        while core.has_work():
            core.step()
        torch.cuda.synchronize()

    for _ in range(3):  # compiles and autotunes every kernel at these sizes
        prefill()
    start = time.perf_counter()
    for _ in range(args.repeats):
        prefill()
    prefill_ms = 1e3 * (time.perf_counter() - start) / args.repeats
    mode = "eager" if args.eager else "graphs"
    print(f"{args.shape} batch {args.batch} x {args.prompt_len} tokens, {mode}: prefill {prefill_ms:.2f} ms "
          f"({args.batch * args.prompt_len / prefill_ms * 1e3:.0f} tok/s)")
    if not args.top:
        return
    print(kernel_table(trace(prefill, args.repeats), args.repeats, args.top))
    profiler = cProfile.Profile()
    for _ in range(args.repeats):
        profiler.runcall(prefill)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.top)
    print(f"host functions over {args.repeats} prefills (cProfile, by own time):")
    print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:6000])


if __name__ == "__main__":
    main()
