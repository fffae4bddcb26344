"""Where a decode step's time goes: the captured graph's replay alone against the whole engine step
(scheduling, staging inputs, replay, reading tokens back), and the replay's kernels one by one.

    python bench/experiments/step_breakdown.py --shape smollm2-135m --batch 1 [--timeline]

Tuning experiments: ``--kernel-config NAME=VALUE`` compiles with a ``KernelConfig`` field changed
(e.g. ``decode_min_split_tokens=64``) and ``--skip-pass NAME`` without one pass of the pipeline
(e.g. ``fuse_rope_attention``), so one GPU session can compare variants of the same step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

# The experiments beside this file first, then the benchmarks' helpers in bench/.
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from models import add_model_arguments, random_engine  # noqa: E402
from graph_gaps import between_graphs_table  # noqa: E402
from timeline import Kernel, critical_path_table  # noqa: E402

from kiln.runtime.sampling import SamplingParams  # noqa: E402


def trace(call, steps: int) -> list:
    """The profiler's device events (kernels and copies) of ``steps`` calls of ``call``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            call()
        torch.cuda.synchronize()
    return [event for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA]


def kernel_table(events: list, steps: int, top: int) -> str:
    """Per-kernel GPU time per replay, from the trace of ``steps`` replays."""
    per_kernel: dict[str, list[float]] = defaultdict(list)
    for event in events:
        per_kernel[event.name[:90]].append(event.device_time)
    total = sum(sum(v) for v in per_kernel.values()) / steps
    lines = [f"kernels per replay: {sum(len(v) for v in per_kernel.values()) / steps:.0f}, "
             f"GPU busy {total:.1f} us per replay",
             "| kernel | calls/step | us/step | us/call |", "|---|---:|---:|---:|"]
    for name, times in sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"| {name} | {len(times) / steps:.0f} | {sum(times) / steps:.1f} | {sum(times) / len(times):.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--timeline", action="store_true",
                        help="also each kernel's share of the replay's critical path (bench/experiments/timeline.py)")
    parser.add_argument("--between", action="store_true",
                        help="also what engine steps run on the GPU between graph replays (bench/experiments/graph_gaps.py)")
    parser.add_argument("--dump-trace", type=Path, default=None,
                        help="write the traced replays' kernels (name, start and end in us) to this JSON file")
    args = parser.parse_args()
    core = random_engine(args, args.prompt_len + args.steps + 128, decode_buckets=(args.batch,))
    params = SamplingParams(temperature=0, max_new_tokens=args.steps + 100, ignore_eos=True)
    for i in range(args.batch):
        core.add_request(f"r{i}", list(range(1 + i, args.prompt_len + 1 + i)), params)
    for _ in range(10):
        core.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        core.step()
    torch.cuda.synchronize()
    step_ms = 1e3 * (time.perf_counter() - start) / args.steps
    graph = core.runner.decode_graphs.graph(args.batch)
    start = time.perf_counter()
    for _ in range(args.steps):
        graph.replay()
    torch.cuda.synchronize()
    replay_ms = 1e3 * (time.perf_counter() - start) / args.steps
    variant = " ".join([*(f"{name}={value}" for name, value in args.kernel_config),
                        *(f"skip {p}" for p in args.skip_pass)])
    label = f"{args.shape} batch {args.batch}" + (f" [{variant}]" if variant else "")
    print(f"{label}: engine step {step_ms:.3f} ms, graph replay alone {replay_ms:.3f} ms, "
          f"host share {step_ms - replay_ms:.3f} ms")
    if args.top or args.timeline or args.dump_trace:
        events = trace(graph.replay, 20)
        kernels = [Kernel(e.name, e.time_range.start, e.time_range.end) for e in events]
        if args.top:
            print(kernel_table(events, 20, args.top))
        if args.timeline:
            print(critical_path_table(kernels, 20, args.top or 40))
        if args.dump_trace:
            args.dump_trace.write_text(json.dumps([dataclasses.asdict(k) for k in kernels]))
    if args.between:
        replay_names = [e.name for e in sorted(trace(graph.replay, 1), key=lambda e: e.time_range.start)]
        steps = [Kernel(e.name, e.time_range.start, e.time_range.end) for e in trace(core.step, 20)]
        print(between_graphs_table(steps, replay_names))


if __name__ == "__main__":
    main()
