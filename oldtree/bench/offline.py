"""Offline throughput of the engine: a shared-prefix workload with the prefix cache on and off, or the
serving benchmark's random workload on random weights of a named shape.

``--workload shared-prefix`` (the default): every request is one long shared prefix (a system prompt)
plus a short question of its own; all are submitted at once to ``kiln.Engine`` and generated greedily
with ``ignore_eos`` so both runs do the same work. The table reports wall time, output and total token
rates, and how many prompt tokens the cache served. For a mixture-of-experts model a second table gives
each sparse layer's load over the timed run without the cache: the tokens its router sent to each
expert (counted on the device by the ``count_experts`` ops, in the routers' launches), and how far the busiest expert is above
the mean (1.0: perfectly even).

``--workload random``: ``--num-requests`` prompts of ``--input-len`` random token ids, each generating
exactly ``--output-len`` tokens, at most ``--max-running`` at once, straight on an ``EngineCore`` (no
text, prefix cache off, every decode and prefill graph captured before the clock starts, as an idle
server captures them): the rate ``bench/serving.py --offline-shape`` sets a server's against.
``--shape S`` runs random weights of shape S (``bench/models.py``; ``--layers`` cuts it) instead of
``--model``; ``--save-artifact ART --tokenizer-dir DIR`` keeps that artifact, with a tokenizer, for
``kiln serve ART`` (the same seed gives the same weights).

    python bench/offline.py --model smollm2-135m-instruct --num-requests 32 --prefix-words 300
    python bench/offline.py --model path/to/Qwen3-30B-A3B --ep 2
    python bench/offline.py --shape smollm2-135m --workload random --num-requests 512 --input-len 256 \\
        --output-len 128 --max-running 64
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from kiln import Engine, SamplingParams
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.engine_options import EngineOptions

WORDS = ("alpha beta gamma delta river mountain forest ocean engine compiler kernel tensor graph cache "
         "token prompt model server request batch page radix tree schedule stream").split()


def workload(num_requests: int, prefix_words: int, question_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    prefix = "You are a careful assistant. Context: " + " ".join(rng.choice(WORDS) for _ in range(prefix_words))
    return [f"{prefix}\nQuestion {i}: " + " ".join(rng.choice(WORDS) for _ in range(question_words)) + "?"
            for i in range(num_requests)]


def run(args: argparse.Namespace, prefix_cache: bool) -> dict:
    prompts = workload(args.num_requests, args.prefix_words, args.question_words, args.seed)
    params = SamplingParams(temperature=0, max_new_tokens=args.output_len, ignore_eos=True)
    with Engine(args.model, dtype=args.dtype, device=args.device, max_seq_len=args.max_seq_len,
                max_batch_tokens=args.max_batch_tokens, kv_cache_tokens=args.kv_cache_tokens,
                enable_prefix_cache=prefix_cache, tp=args.tp, ep=args.ep) as engine:
        engine.generate(prompts[:1], SamplingParams(temperature=0, max_new_tokens=2))  # warm-up
        engine.core.cache.reset()
        warm_load = engine.core.runner.expert_load.read()
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        seconds = time.perf_counter() - start
        load = {layer: [n - before for n, before in zip(counts, warm_load[layer])]
                for layer, counts in engine.core.runner.expert_load.read().items()}
    prompt_tokens = sum(o.usage.prompt_tokens for o in outputs)
    output_tokens = sum(o.usage.completion_tokens for o in outputs)
    cached = sum(o.usage.cached_tokens for o in outputs)
    return {"prefix_cache": prefix_cache, **rates(seconds, len(outputs), prompt_tokens, output_tokens),
            "cached_tokens": cached, "expert_load": load, "token_ids": [o.token_ids for o in outputs]}


def expert_load_table(load: dict[int, list[int]]) -> list[str]:
    """Markdown rows: per sparse layer the tokens routed, the busiest expert over the mean, and every expert's count."""
    lines = ["| layer | routed tokens | max / mean | tokens per expert |", "|---|---|---|---|"]
    for layer, counts in sorted(load.items()):
        total = sum(counts)
        imbalance = max(counts) * len(counts) / total if total else 0.0
        lines.append(f"| {layer} | {total} | {imbalance:.2f} | {' '.join(map(str, counts))} |")
    return lines


def rates(seconds: float, requests: int, prompt_tokens: int, output_tokens: int) -> dict:
    return {"seconds": round(seconds, 3), "requests": requests, "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens, "output_tok_s": round(output_tokens / seconds, 1),
            "total_tok_s": round((prompt_tokens + output_tokens) / seconds, 1)}


def run_random(args: argparse.Namespace, artifact: str) -> dict:
    """The random workload on an ``EngineCore``: every request queued at once, steps until all finish."""
    rng = random.Random(args.seed)
    core = EngineCore(artifact, EngineOptions(device=args.device, kv_cache_tokens=args.kv_cache_tokens,
                                              max_batch_tokens=args.max_batch_tokens, max_running=args.max_running,
                                              enable_prefix_cache=False))
    try:
        params = SamplingParams(temperature=0, max_new_tokens=args.output_len, ignore_eos=True)
        finish(core, {"warm-up": [1 + rng.randrange(core.vocab_size - 1) for _ in range(args.input_len)]},
               SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True))
        # Every step graph captured first, as an idle server does (the timed run would pay the
        # captures otherwise: the prefill graphs took ~4 s of Llama-3-8B's 8.4 s at 256 running on an H100).
        while core.warm_up_idle():
            pass
        prompts = {f"r{i}": [rng.randrange(core.vocab_size) for _ in range(args.input_len)]
                   for i in range(args.num_requests)}
        start = time.perf_counter()
        output_tokens = finish(core, prompts, params)
        seconds = time.perf_counter() - start
    finally:
        core.close()
    return rates(seconds, len(prompts), args.num_requests * args.input_len, output_tokens)


def finish(core: EngineCore, prompts: dict[str, list[int]], params: SamplingParams) -> int:
    """Runs ``prompts`` to the end; the tokens generated."""
    for rid, prompt_ids in prompts.items():
        core.add_request(rid, prompt_ids, params)
    tokens = 0
    while core.has_work():
        for event in core.step():
            tokens += len(event.token_ids)
            if event.finish_reason is not None:
                core.forget_if_done(event.rid)
    return tokens


def random_weights(args: argparse.Namespace, on_gpu: bool, workdir: Path) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import models

    out = args.save_artifact or workdir / "model.kiln"
    return str(models.random_artifact(args.shape, out, on_gpu, args.tokenizer_dir, args.layers, args.max_seq_len))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--shape", default=None, help="random weights of this shape (bench/models.py) instead of --model")
    parser.add_argument("--layers", type=int, default=None, help="cut --shape to this many layers")
    parser.add_argument("--tokenizer-dir", type=Path, default=None, help="tokenizer files for --shape's artifact")
    parser.add_argument("--save-artifact", type=Path, default=None, help="keep --shape's artifact here")
    parser.add_argument("--workload", choices=["shared-prefix", "random"], default="shared-prefix")
    parser.add_argument("--dtype", default=None, help="default: bf16 on GPU, fp32 on CPU")
    parser.add_argument("--device", default=None)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prefix-words", type=int, default=300)
    parser.add_argument("--question-words", type=int, default=12)
    parser.add_argument("--input-len", type=int, default=256, help="random: prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-running", type=int, default=None, help="random: most requests at once")
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-tokens", type=int, default=None)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel ranks, for a MoE model (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    on_gpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    args.dtype = args.dtype or ("bf16" if on_gpu else "fp32")
    if args.kv_cache_tokens is None and not on_gpu:
        args.kv_cache_tokens = 65536
    hardware = torch.cuda.get_device_name() if on_gpu else f"{platform.processor() or platform.machine()} CPU, " \
        f"{torch.get_num_threads()} threads"
    with tempfile.TemporaryDirectory() as workdir:
        model = random_weights(args, on_gpu, Path(workdir)) if args.shape else args.model
        if args.workload == "random":
            results = [run_random(args, model)]
            same = None
        else:
            args.model = model
            results = [run(args, prefix_cache=True), run(args, prefix_cache=False)]
            same = results[0].pop("token_ids") == results[1].pop("token_ids")
    name = f"random {args.shape}" + (f" ({args.layers} layers)" if args.layers else "") if args.shape else args.model
    if same is None:
        r = results[0]
        print(f"# offline, {name}, {args.dtype}, {hardware}, {r['requests']} requests of {args.input_len} + "
              f"{args.output_len} tokens, at most {args.max_running or 'all'} at once")
        print("| seconds | prompt tok | output tok | output tok/s | total tok/s |\n|---|---|---|---|---|")
        print(f"| {r['seconds']} | {r['prompt_tokens']} | {r['output_tokens']} | {r['output_tok_s']} | "
              f"{r['total_tok_s']} |")
    else:
        print(f"# offline, {name}, {args.dtype}, {hardware}, {args.num_requests} requests, "
              f"outputs identical with and without the cache: {same}")
        print("| prefix cache | seconds | prompt tok | cached tok | output tok/s | total tok/s |")
        print("|---|---|---|---|---|---|")
        for r in results:
            print(f"| {'on' if r['prefix_cache'] else 'off'} | {r['seconds']} | {r['prompt_tokens']} | "
                  f"{r['cached_tokens']} | {r['output_tok_s']} | {r['total_tok_s']} |")
        if results[1]["expert_load"]:
            print(f"\n# expert load: tokens per expert per sparse layer (ep={args.ep}), the run without the cache")
            print("\n".join(expert_load_table(results[1]["expert_load"])))
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                                        "hardware": hardware, "identical_outputs": same, "results": results},
                                       indent=1))


if __name__ == "__main__":
    main()
