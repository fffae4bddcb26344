"""End-to-end decode and prefill throughput of kiln against HF transformers, same random weights.

For each model shape (random bf16 weights of Llama-3-8B and SmolLM2-135M), in one process and on
the same weights: kiln (triton backend, decode as CUDA graphs) and HF ``generate`` eager and with
``cache_implementation="static"`` (HF's fastest path here). Decode rate excludes prefill: each run
is timed with 1 new token and with 1 + N, and the difference gives N decode steps. Prefill rate is
prompt tokens over the 1-token run. The roofline is one read of all weights per step at the copy
bandwidth measured in the same run.

    python bench/decode.py --shapes smollm2-135m llama3-8b --batches 1 8 64 --out results.json

``--quantization none fp8 mxfp4 w8a8_int8 w8a16_int8`` compiles kiln once per method (``none``: the
bf16 weights) from the same random weights and measures each in the same run; HF runs once per batch
(its weights are bf16 whatever kiln's). Each kiln row's roofline is one read of its own artifact's
weight bytes (the quantized bytes and their scales), and ``x none`` is its decode rate over the bf16
row's. A method named with ``+lm_head`` (``fp8+lm_head``) quantizes the lm_head too (``--quantize-lm-head``).
``--kernel-config NAME=VALUE`` and ``--skip-pass NAME`` go into kiln's compile (a variant under test).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import random_model  # noqa: E402

from kiln.artifact_format import weights_file  # noqa: E402
from kiln.cli_compile import add_tuning_options, tuning_options  # noqa: E402
from kiln.compiler.compile import compile_model  # noqa: E402
from kiln.compiler.options import CompileOptions  # noqa: E402
from kiln.compiler.quantization import METHODS  # noqa: E402
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


def bench_kiln(source, quantization: str, prompts: dict[int, list[list[int]]], args: argparse.Namespace,
               bandwidth: float) -> list[dict]:
    """kiln's rows for one quantization method (``none``: bf16; ``METHOD+lm_head``: the lm_head too) of
    one shape, one per batch."""
    method, _, head = quantization.partition("+")
    buckets = tuple(sorted(set(args.batches)))
    with tempfile.TemporaryDirectory() as tmp:
        artifact = compile_model(source, Path(tmp) / "model.kiln", CompileOptions(
            dtype="bf16", backend="triton", max_batch_tokens=max(max(args.batches) * args.prompt_len, 2048),
            max_batch_size=max(buckets), max_seq_len=args.prompt_len + args.new_tokens + 16, page_size=16,
            quantization=None if method == "none" else method, quantize_lm_head=head == "lm_head",
            **tuning_options(args)))
        weight_bytes = (artifact / weights_file(0)).stat().st_size
        core = EngineCore(str(artifact), EngineOptions(device="cuda", kv_cache_tokens=max(buckets) * 1024,
                                                       enable_prefix_cache=False, decode_buckets=buckets))
    rows = []
    for batch in args.batches:
        ids = prompts[batch]
        rows.append({"quantization": quantization, "batch": batch, "weights_GB": weight_bytes / 1e9,
                     "roofline_ms": 1e3 * weight_bytes / bandwidth,
                     "kiln": rates(lambda n: run_core(core, ids, n), batch, args.prompt_len, args.new_tokens)})
        # As soon as measured: a run cut short by a time limit still shows what it got.
        kiln = rows[-1]["kiln"]
        print(f"kiln {quantization} batch {batch}: {kiln['decode_tok_s']:.0f} tok/s, {kiln['ms_per_step']:.3f} "
              f"ms/step (roofline {rows[-1]['roofline_ms']:.3f} ms)", flush=True)
    del core
    gc.collect()  # the core's reference cycles hold its weights and KV pages until collected
    torch.cuda.empty_cache()
    return rows


def bench_shape(shape: str, args: argparse.Namespace, bandwidth: float, log) -> list[dict]:
    model, source = random_model(shape)
    generator = torch.Generator().manual_seed(0)
    prompts = {batch: torch.randint(0, model.config.vocab_size, (batch, args.prompt_len), generator=generator)
               for batch in args.batches}
    ids = {batch: [p.tolist() for p in batch_prompts] for batch, batch_prompts in prompts.items()}
    rows = []
    for quantization in args.quantization:
        rows += bench_kiln(source, quantization, ids, args, bandwidth)
    hf = {}
    for batch in args.batches:
        gpu_prompts = prompts[batch].cuda()
        hf[batch] = {"hf_eager": rates(lambda n: run_hf(model, gpu_prompts, n, False), batch, args.prompt_len,
                                       args.new_tokens)}
        if batch in args.static_batches:
            hf[batch]["hf_static"] = rates(lambda n: run_hf(model, gpu_prompts, n, True), batch, args.prompt_len,
                                           args.new_tokens)
    for row in rows:
        row.update({"shape": shape, **hf[row["batch"]]})
        log(json.dumps(row))
    del model
    torch.cuda.empty_cache()
    return rows


def table(rows: list[dict], bandwidth: float) -> str:
    lines = [f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; {torch.cuda.get_device_name()}",
             "| shape | quantization | batch | kiln tok/s | x none | kiln ms/step | weights GB | roofline ms/step | "
             "kiln % of roofline | HF eager tok/s | HF static tok/s | kiln / best HF | kiln prefill tok/s | "
             "HF eager prefill tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    plain = {(r["shape"], r["batch"]): r["kiln"]["decode_tok_s"] for r in rows if r["quantization"] == "none"}
    for r in rows:
        kiln, eager, static = r["kiln"], r["hf_eager"], r.get("hf_static")
        best = max(eager["decode_tok_s"], static["decode_tok_s"] if static else 0.0)
        static_text = f"{static['decode_tok_s']:.0f}" if static else "-"
        base = plain.get((r["shape"], r["batch"]))
        speedup = f"{kiln['decode_tok_s'] / base:.2f}x" if base else "-"
        lines.append(
            f"| {r['shape']} | {r['quantization']} | {r['batch']} | {kiln['decode_tok_s']:.0f} | {speedup} | "
            f"{kiln['ms_per_step']:.3f} | {r['weights_GB']:.2f} | {r['roofline_ms']:.3f} | "
            f"{100 * r['roofline_ms'] / kiln['ms_per_step']:.0f}% | {eager['decode_tok_s']:.0f} | {static_text} | "
            f"{kiln['decode_tok_s'] / best:.1f}x | {kiln['prefill_tok_s']:.0f} | {eager['prefill_tok_s']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["smollm2-135m", "llama3-8b"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--static-batches", nargs="*", type=int, default=[1])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--quantization", nargs="+", default=["none"],
                        choices=["none", *METHODS, *(f"{m}+lm_head" for m in METHODS)],
                        help="kiln's weights: none (bf16) and/or quantization methods, each compiled and measured "
                             "(METHOD+lm_head: the lm_head quantized too)")
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
