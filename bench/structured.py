"""The cost of constrained decoding: time per output token with and without a JSON-schema constraint.

Runs SmolLM2 (or any model) through ``kiln.Engine`` at batch 1 and 16, greedy, the same prompts
both ways; the schema's grammar is compiled once before timing (a warm cache, as a server sees a
repeated schema). Reports ms per output token and the overhead of the constraint.

    python bench/structured.py --batches 1 16
    python bench/structured.py --random-shape smollm2-135m --tokenizer-dir DIR   # GPU: random weights

``--random-shape`` builds random bf16 weights of a real shape in memory (for the GPU machine, which
cannot hold the real checkpoint) and takes the tokenizer files from ``--tokenizer-dir``; the
constraint then decides what is generated, which is what this measures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from kiln import Engine, SamplingParams
from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.compiler.sources.hf import TOKENIZER_FILES

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
    if params.json_schema is not None:
        # Valid by construction: every output the grammar ended must parse (a cut-off one may not).
        for out in outputs:
            if out.finish_reason == "stop":
                json.loads(out.text)
    return seconds, sum(o.usage.completion_tokens for o in outputs)


def random_artifact(shape: str, tokenizer_dir: Path | None, workdir: Path, on_gpu: bool) -> Path:
    """An artifact of random ``shape`` weights with the tokenizer files found in ``tokenizer_dir``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from models import random_model

    if tokenizer_dir is None or not (tokenizer_dir / "tokenizer.json").is_file():
        sys.exit("--random-shape needs --tokenizer-dir holding tokenizer.json (and tokenizer_config.json)")
    _, source = random_model(shape, dtype=torch.bfloat16 if on_gpu else torch.float32,
                             device="cuda" if on_gpu else "cpu")
    files = tuple(tokenizer_dir / n for n in TOKENIZER_FILES if (tokenizer_dir / n).is_file())
    return compile_model(dataclasses.replace(source, tokenizer_files=files), workdir / "model.kiln", CompileOptions(
        dtype="bf16" if on_gpu else "fp32", backend="triton" if on_gpu else "torch", max_seq_len=2048))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default=None)
    parser.add_argument("--random-shape", default=None, help="random weights of this shape (bench/models.py)")
    parser.add_argument("--tokenizer-dir", type=Path, default=None, help="tokenizer files for --random-shape")
    args = parser.parse_args()
    on_gpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    model = args.model
    if args.random_shape:
        model = random_artifact(args.random_shape, args.tokenizer_dir, Path(tempfile.mkdtemp()), on_gpu)
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
