"""The cost of constrained decoding: time per output token with and without a JSON-schema constraint.

Runs SmolLM2 (or any model) through ``kiln.Engine`` at batch 1, 16 and 64, greedy, the same prompts
both ways; the schema's grammar is compiled once before timing (a warm cache, as a server sees a
repeated schema). Requests stream, and the time per output token (TPOT) of each is the time from
its first token to its last over the tokens after the first: decode speed, the usual serving metric,
without the prefill and request set-up that time to first token covers. Also reported: wall time
over all output tokens, which includes them, and the grammar's host time per engine step on the
engine's thread (the step's mask filled, or handed to the filler thread and waited for, and its tokens
accepted, all constrained rows at once: ``Constraints.start_mask``, ``PendingMask.wait`` and
``Constraints.advance_all``, each reported apart too), to set beside the GPU's step time: the overlap
hides it only while the host's whole step stays under the GPU's. ``--profile`` prints where the
engine's steps spend host time (cProfile) for each batch size and mode.

    python bench/structured.py --batches 1 16 64
    python bench/structured.py --random-shape smollm2-135m --tokenizer-dir DIR   # GPU: random weights

``--random-shape`` builds random bf16 weights of a real shape in memory (for the GPU machine, which
cannot hold the real checkpoint) and takes the tokenizer files from ``--tokenizer-dir``; the
constraint then decides what is generated, which is what this measures.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import dataclasses
import json
import platform
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

from kiln import Engine, SamplingParams
from kiln.runtime.constraints import Constraints
from kiln.runtime.grammar.step_mask import PendingMask

# The JSON schema every constrained request follows (also `bench/serving.py --json-schema`'s in
# bench/experiments/gpu_session.sh): a person with a name, an age, hobbies and a city.
SCHEMA = json.loads((Path(__file__).resolve().parent / "person_schema.json").read_text())


@dataclasses.dataclass
class Timing:
    seconds: float  # wall time of the whole batch
    tokens: int  # output tokens of all requests
    tpot_ms: float  # mean over requests of (last token time - first token time) / (tokens - 1)
    grammar_us_per_step: float  # host time filling masks and accepting tokens, over the engine's steps
    grammar_parts_us: dict[str, float]  # that time by part (start_mask, wait, advance_all), per step


async def _stream_one(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[list[float], str, str]:
    times, text, reason = [], "", ""
    async for delta in engine.async_stream(prompt, params):
        times.extend([time.perf_counter()] * len(delta.token_ids))
        text += delta.text
        reason = delta.finish_reason or reason
    return times, text, reason


async def _stream_all(engine: Engine, prompts: list[list[int]], params: SamplingParams):
    return await asyncio.gather(*(_stream_one(engine, p, params) for p in prompts))


def _clocked(function, clock: list[float]):
    """``function``, adding the seconds each call takes to ``clock[0]`` and counting calls in ``clock[1]``."""
    def call(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            clock[0] += time.perf_counter() - started
            clock[1] += 1
    return call


def timed(engine: Engine, prompts: list[list[int]], params: SamplingParams, profile: str | None = None) -> Timing:
    profiler = cProfile.Profile() if profile else None
    core = engine.core
    step, start_mask, advance_all, wait = core.step, core.constraints.start_mask, Constraints.advance_all, PendingMask.wait
    steps = [0.0, 0]
    parts = {"start": [0.0, 0], "wait": [0.0, 0], "accept": [0.0, 0]}
    if profiler is not None:
        # The engine's thread runs the steps: profile those calls (the benchmark's thread only waits).
        def profiled_step():
            profiler.enable()
            try:
                return step()
            finally:
                profiler.disable()
        core.step = _clocked(profiled_step, steps)
    else:
        core.step = _clocked(step, steps)
    core.constraints.start_mask = _clocked(start_mask, parts["start"])
    Constraints.advance_all = staticmethod(_clocked(advance_all, parts["accept"]))
    PendingMask.wait = _clocked(wait, parts["wait"])
    start = time.perf_counter()
    try:
        results = asyncio.run(_stream_all(engine, prompts, params))
    finally:
        core.step, core.constraints.start_mask = step, start_mask
        Constraints.advance_all = staticmethod(advance_all)
        PendingMask.wait = wait
    seconds = time.perf_counter() - start
    if params.json_schema is not None:
        # Valid by construction: every output the grammar ended must parse (a cut-off one may not).
        for _, text, reason in results:
            if reason == "stop":
                # (strict=False: xgrammar's JSON strings admit raw control characters, which a random
                # model's output may hold and Python's strict parser alone refuses.)
                json.loads(text, strict=False)
    if profiler is not None:
        print(f"## engine steps, {profile}: host time by function (cProfile, tottime)")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
    gaps = [(t[-1] - t[0]) / (len(t) - 1) for t, _, _ in results if len(t) > 1]
    per_step = {name: 1e6 * clock[0] / max(1, steps[1]) for name, clock in parts.items()}
    return Timing(seconds, sum(len(t) for t, _, _ in results), 1e3 * sum(gaps) / max(1, len(gaps)),
                  sum(per_step.values()), per_step)


def random_artifact(shape: str, tokenizer_dir: Path | None, workdir: Path, on_gpu: bool, layers: int | None) -> Path:
    """An artifact of random ``shape`` weights (``layers`` of them, None: all) with the tokenizer files
    found in ``tokenizer_dir``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import models

    if tokenizer_dir is None or not (tokenizer_dir / "tokenizer.json").is_file():
        sys.exit("--random-shape needs --tokenizer-dir holding tokenizer.json (and tokenizer_config.json)")
    return models.random_artifact(shape, workdir / "model.kiln", on_gpu, tokenizer_dir, layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default=None)
    parser.add_argument("--random-shape", default=None, help="random weights of this shape (bench/models.py)")
    parser.add_argument("--tokenizer-dir", type=Path, default=None, help="tokenizer files for --random-shape")
    parser.add_argument("--layers", type=int, default=None,
                        help="cut --random-shape to this many layers (on the CPU: the host's work shows)")
    parser.add_argument("--profile", action="store_true", help="print the engine steps' host profile of each run")
    args = parser.parse_args()
    on_gpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    model = args.model
    if args.random_shape:
        model = random_artifact(args.random_shape, args.tokenizer_dir, Path(tempfile.mkdtemp()), on_gpu, args.layers)
        args.model = f"random {args.random_shape}"
    with Engine(model, dtype="bf16" if on_gpu else "fp32", device=args.device, max_seq_len=2048,
                kv_cache_tokens=None if on_gpu else 65536, enable_prefix_cache=False) as engine:
        rows = []
        for batch in args.batches:
            prompts = [engine.chat_prompt_ids([{"role": "user", "content": f"Invent person number {i} and describe "
                                                f"them as JSON with name, age, hobbies and city."}])
                       for i in range(batch)]
            # ignore_eos on the free run keeps its length equal to the constrained one's.
            free = SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens)
            constrained = SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens, json_schema=SCHEMA)
            # The first constrained run at a batch size compiles the grammar and any kernel specialized
            # for that size (on the H100, 2026-12-06, a ~1 s stall the timed runs then included): warm
            # both ways at this size, and report the first constrained run's wall time apart.
            first_json = timed(engine, prompts, constrained)
            timed(engine, prompts, dataclasses.replace(constrained, json_schema=None, ignore_eos=True))
            label = f"batch {batch}, %s" if args.profile else None
            json_run = timed(engine, prompts, constrained, label and label % "JSON schema")
            free.max_new_tokens = max(1, json_run.tokens // batch)
            free.ignore_eos = True
            free_run = timed(engine, prompts, free, label and label % "unconstrained")
            wall_c, wall_f = 1e3 * json_run.seconds / json_run.tokens, 1e3 * free_run.seconds / free_run.tokens
            rows.append({"batch": batch, "tokens_per_request": json_run.tokens / batch,
                         "free_tpot_ms": free_run.tpot_ms, "json_tpot_ms": json_run.tpot_ms,
                         "tpot_overhead": json_run.tpot_ms / free_run.tpot_ms - 1,
                         "free_wall_ms_per_token": wall_f, "json_wall_ms_per_token": wall_c,
                         "wall_overhead": wall_c / wall_f - 1, "grammar_us_per_step": json_run.grammar_us_per_step,
                         "grammar_parts_us": json_run.grammar_parts_us,
                         "first_json_wall_ms_per_token": 1e3 * first_json.seconds / first_json.tokens})
    hardware = torch.cuda.get_device_name() if on_gpu else f"{platform.machine()} CPU, {torch.get_num_threads()} threads"
    print(f"# structured outputs, {args.model}, {hardware}; ms per output token")
    print("| batch | tokens/request | TPOT unconstrained | TPOT JSON schema | TPOT overhead "
          "| wall/token unconstrained | wall/token JSON schema | wall overhead | grammar host µs/step "
          "(start / wait / accept) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['tokens_per_request']:.0f} | {r['free_tpot_ms']:.3f} | {r['json_tpot_ms']:.3f} | "
              f"{100 * r['tpot_overhead']:+.1f}% | {r['free_wall_ms_per_token']:.3f} | "
              f"{r['json_wall_ms_per_token']:.3f} | {100 * r['wall_overhead']:+.1f}% | "
              f"{r['grammar_us_per_step']:.0f} ({' / '.join(f'{v:.0f}' for v in r['grammar_parts_us'].values())}) |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
