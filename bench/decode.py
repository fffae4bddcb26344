"""End-to-end decode and prefill throughput of kiln against HF transformers, same random weights.

For each model shape (random bf16 weights of Llama-3-8B and SmolLM2-135M), in one process and on
the same weights: kiln (triton backend, decode as CUDA graphs) and HF ``generate`` eager and with
``cache_implementation="static"`` (HF's fastest path here). Decode rate excludes prefill: each run
is timed with 1 new token and with 1 + N, and the difference gives N decode steps. Prefill rate is
prompt tokens over the 1-token run. The roofline is one read of all weights per step at the copy
bandwidth measured in the same run.

    python bench/decode.py --shapes smollm2-135m llama3-8b --batches 1 8 64 --out results.json

``--kernel-config NAME=VALUE`` and ``--skip-pass NAME`` go into kiln's compile (a variant under test).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import random_model  # noqa: E402

from kiln.cli import add_tuning_options, tuning_options  # noqa: E402
from kiln.compiler.compile import compile_model  # noqa: E402
from kiln.compiler.options import CompileOptions  # noqa: E402
from kiln.runtime.engine_core import EngineCore  # noqa: E402
from kiln.runtime.engine_options import EngineOptions  # noqa: E402
from kiln.runtime.sampling import SamplingParams  # noqa: E402


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * 10 / (time.perf_counter() - start)


def run_core(core: EngineCore, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        core.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
    while core.has_work():
        core.step()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def run_hf(model, prompts: torch.Tensor, new_tokens: int, static: bool) -> float:
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if static:
        kwargs["cache_implementation"] = "static"
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(prompts, attention_mask=torch.ones_like(prompts), **kwargs)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def rates(timer, batch: int, prompt_len: int, new_tokens: int) -> dict:
    timer(1)  # warm-up (compiles, captures, allocates)
    prefill = min(timer(1) for _ in range(2))
    total = min(timer(1 + new_tokens) for _ in range(2))
    decode = max(total - prefill, 1e-9)
    return {"prefill_s": prefill, "decode_s": decode, "decode_tok_s": batch * new_tokens / decode,
            "ms_per_step": 1e3 * decode / new_tokens, "prefill_tok_s": batch * prompt_len / prefill}


def bench_shape(shape: str, args: argparse.Namespace, bandwidth: float, log) -> list[dict]:
    model, source = random_model(shape)
    weight_bytes = sum(t.numel() * t.element_size() for t in source.tensors._tensors.values())
    roofline_ms = 1e3 * weight_bytes / bandwidth
    buckets = tuple(sorted(set(args.batches)))
    with tempfile.TemporaryDirectory() as tmp:
        artifact = compile_model(source, Path(tmp) / "model.kiln", CompileOptions(
            dtype="bf16", backend="triton", max_batch_tokens=max(max(args.batches) * args.prompt_len, 2048),
            max_batch_size=max(buckets), max_seq_len=args.prompt_len + args.new_tokens + 16, page_size=16,
            **tuning_options(args)))
        core = EngineCore(str(artifact), EngineOptions(device="cuda", kv_cache_tokens=max(buckets) * 1024,
                                                       enable_prefix_cache=False, decode_buckets=buckets))
    rows = []
    generator = torch.Generator().manual_seed(0)
    for batch in args.batches:
        prompts = torch.randint(0, model.config.vocab_size, (batch, args.prompt_len), generator=generator)
        ids = [p.tolist() for p in prompts]
        row = {"shape": shape, "batch": batch, "weights_GB": weight_bytes / 1e9, "roofline_ms": roofline_ms}
        row["kiln"] = rates(lambda n: run_core(core, ids, n), batch, args.prompt_len, args.new_tokens)
        gpu_prompts = prompts.cuda()
        row["hf_eager"] = rates(lambda n: run_hf(model, gpu_prompts, n, False), batch, args.prompt_len,
                                args.new_tokens)
        if batch in args.static_batches:
            row["hf_static"] = rates(lambda n: run_hf(model, gpu_prompts, n, True), batch, args.prompt_len,
                                     args.new_tokens)
        log(json.dumps(row))
        rows.append(row)
    del core, model
    torch.cuda.empty_cache()
    return rows


def table(rows: list[dict], bandwidth: float) -> str:
    lines = [f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; {torch.cuda.get_device_name()}",
             "| shape | batch | kiln tok/s | kiln ms/step | roofline ms/step | kiln % of roofline | HF eager tok/s | "
             "HF static tok/s | kiln / best HF | kiln prefill tok/s | HF eager prefill tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kiln, eager, static = r["kiln"], r["hf_eager"], r.get("hf_static")
        best = max(eager["decode_tok_s"], static["decode_tok_s"] if static else 0.0)
        static_text = f"{static['decode_tok_s']:.0f}" if static else "-"
        lines.append(
            f"| {r['shape']} | {r['batch']} | {kiln['decode_tok_s']:.0f} | {kiln['ms_per_step']:.3f} | "
            f"{r['roofline_ms']:.3f} | {100 * r['roofline_ms'] / kiln['ms_per_step']:.0f}% | "
            f"{eager['decode_tok_s']:.0f} | {static_text} | {kiln['decode_tok_s'] / best:.1f}x | "
            f"{kiln['prefill_tok_s']:.0f} | {eager['prefill_tok_s']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["smollm2-135m", "llama3-8b"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--static-batches", nargs="*", type=int, default=[1])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None)
    add_tuning_options(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/decode.py needs a CUDA GPU")
    bandwidth = copy_bandwidth()
    rows = []
    for shape in args.shapes:
        rows += bench_shape(shape, args, bandwidth, lambda line: print(line, flush=True))
    print(table(rows, bandwidth))
    if args.out:
        args.out.write_text(json.dumps({"bandwidth": bandwidth, "rows": rows, "args": vars(args) | {"out": str(args.out)}},
                                       indent=1))


if __name__ == "__main__":
    main()
