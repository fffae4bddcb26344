"""The cost of constrained decoding: time per output token with and without a JSON-schema constraint.

Runs SmolLM2 (or any model) through ``kiln.Engine`` at batch 1 and 16, greedy, the same prompts
both ways; the schema's grammar is compiled once before timing (a warm cache, as a server sees a
repeated schema). Reports ms per output token and the overhead of the constraint.

    python bench/structured.py --batches 1 16
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from kiln import Engine, SamplingParams

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    "city": {"type": "string", "maxLength": 30}},
    "required": ["name", "age", "hobbies", "city"]}


def timed(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    return seconds, sum(o.usage.completion_tokens for o in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    on_gpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    with Engine(args.model, dtype="bf16" if on_gpu else "fp32", device=args.device, max_seq_len=2048,
                kv_cache_tokens=None if on_gpu else 65536, enable_prefix_cache=False) as engine:
        rows = []
        for batch in args.batches:
            prompts = [engine.chat_prompt_ids([{"role": "user", "content": f"Invent person number {i} and describe "
                                                f"them as JSON with name, age, hobbies and city."}])
                       for i in range(batch)]
            # ignore_eos on the free run keeps its length equal to the constrained one's.
            free = SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens)
            constrained = SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens, json_schema=SCHEMA)
            timed(engine, prompts[:1], constrained)  # compiles the grammar, warms everything up
            seconds_c, tokens_c = timed(engine, prompts, constrained)
            free.max_new_tokens = max(1, tokens_c // batch)
            free.ignore_eos = True
            seconds_f, tokens_f = timed(engine, prompts, free)
            per_c, per_f = 1e3 * seconds_c / tokens_c, 1e3 * seconds_f / tokens_f
            rows.append({"batch": batch, "free_ms_per_token": per_f, "json_ms_per_token": per_c,
                         "overhead": per_c / per_f - 1})
    hardware = torch.cuda.get_device_name() if on_gpu else f"{platform.machine()} CPU, {torch.get_num_threads()} threads"
    print(f"# structured outputs, {args.model}, {hardware}; ms per output token (wall, whole batch)")
    print("| batch | unconstrained | JSON schema | overhead |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['free_ms_per_token']:.2f} | {r['json_ms_per_token']:.2f} | "
              f"{100 * r['overhead']:+.1f}% |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
