"""Multi-LoRA decode overhead: the same random model without LoRA and with 8 adapters in the batch.

Random bf16 weights of a real shape (default Llama-3-8B) compiled twice in one run, from the same
tensors: the base artifact (no LoRA hooks) and a LoRA artifact (``--max-loras`` slots of rank
``--rank`` on all seven projections), with ``--adapters`` random PEFT adapters written to a
temporary directory. For each batch size, three decode rates: the base artifact, the LoRA artifact
serving the base model (slot -1 everywhere: the hooks' cost alone), and the LoRA artifact with the
batch's requests spread over the adapters (batch 1: one adapter). Decode time excludes prefill:
each run is timed with 1 new token and with 1 + N, and the difference is N decode steps. The
overhead is the LoRA step time over the base step time, minus one.

    python bench/lora_decode.py --shape llama3-8b --batches 1 64 --out lora.json
    python bench/lora_decode.py --shape llama3-8b --batches 64 --kernel-config lora_min_split_k=512

``--kernel-config NAME=VALUE`` compiles both artifacts with a ``KernelConfig`` field changed (the
LoRA kernels' tunables are its ``lora_*`` fields); the JSON records the changes.

On a CPU (``--device cpu``, torch backend) it runs the same code on a small shape, for tests.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import SHAPES, random_model  # noqa: E402

from kiln.cli_compile import add_tuning_options, tuning_options  # noqa: E402
from kiln.compiler.compile import compile_model  # noqa: E402
from kiln.compiler.options import CompileOptions  # noqa: E402
from kiln.lora_layout import TARGET_MODULES  # noqa: E402
from kiln.runtime.engine_core import EngineCore  # noqa: E402
from kiln.runtime.engine_options import EngineOptions  # noqa: E402
from kiln.runtime.sampling import SamplingParams  # noqa: E402

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def write_adapter(directory: Path, config: dict, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter (non-zero A and B) on every target of every layer of ``config``."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            block = "self_attn" if module in _ATTENTION else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * fan_in ** -0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.01
    directory.mkdir(parents=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()},
              str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGET_MODULES)}))
    return directory


def decode_seconds(core: EngineCore, prompts: list[list[int]], loras: list[str | None], new_tokens: int) -> float:
    """Seconds of ``new_tokens`` decode steps: a run of 1 + new_tokens tokens less a run of 1."""
    def run(tokens: int) -> float:
        params = SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True)
        synchronize(core)
        start = time.perf_counter()
        for i, (prompt, lora) in enumerate(zip(prompts, loras)):
            core.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params, lora=lora)
        while core.has_work():
            core.step()
        synchronize(core)
        return time.perf_counter() - start

    run(1 + new_tokens)  # warm-up: graphs captured, adapters resident
    return run(1 + new_tokens) - run(1)


def synchronize(core: EngineCore) -> None:
    if core.runner.device.type == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="cut the shape to this many layers")
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    add_tuning_options(parser, skip_pass=False)  # --kernel-config, for both artifacts (e.g. lora_min_split_k=512)
    args = parser.parse_args(argv)
    on_gpu = args.device == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    _, source = random_model(args.shape, dtype=dtype, layers=args.layers, device=args.device,
                             vocab_size=args.vocab_size)
    batch = max(args.batches)
    seq_len = args.prompt_len + args.new_tokens + 8
    common = dict(dtype="bf16" if on_gpu else "fp32", backend="triton" if on_gpu else "torch",
                  max_batch_tokens=max(512, batch * args.prompt_len), max_batch_size=batch, max_seq_len=seq_len,
                  kernel_config=tuning_options(args)["kernel_config"])
    results = {"shape": args.shape, "layers": source.config["num_hidden_layers"], "rank": args.rank,
               "kernel_config": common["kernel_config"].changes(),
               "adapters": args.adapters, "device": torch.cuda.get_device_name() if on_gpu else "cpu", "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        engine = EngineOptions(device=args.device, kv_cache_tokens=batch * seq_len + 1024, enable_prefix_cache=False)
        base = compile_model(source, tmp / "base.kiln", CompileOptions(**common))
        cores = {"base": EngineCore(str(base), engine)}
        # The core holds its weights now: two Llama-3-8B artifacts at once (32 GB) filled the GPU
        # machine's disk, so the base one goes before the LoRA one is written.
        shutil.rmtree(base)
        lora = compile_model(source, tmp / "lora.kiln", CompileOptions(**common, max_loras=args.adapters,
                                                                           max_lora_rank=args.rank))
        cores["lora"] = EngineCore(str(lora), engine)
        names = [f"adapter{i}" for i in range(args.adapters)]
        for i, name in enumerate(names):
            cores["lora"].load_lora(name, str(write_adapter(tmp / name, source.config, args.rank, seed=i)))
        generator = torch.Generator().manual_seed(0)
        vocab = source.config["vocab_size"]
        for size in args.batches:
            prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=generator).tolist() for _ in range(size)]
            runs = {"base": (cores["base"], [None] * size),
                    "lora artifact, base model": (cores["lora"], [None] * size),
                    f"{min(size, args.adapters)} adapters": (cores["lora"], [names[i % len(names)]
                                                                             for i in range(size)])}
            seconds = {label: decode_seconds(core, prompts, loras, args.new_tokens)
                       for label, (core, loras) in runs.items()}
            step = {label: s / args.new_tokens for label, s in seconds.items()}
            row = {"batch": size, **{f"{label} ms/step": round(1e3 * s, 4) for label, s in step.items()},
                   "overhead": round(step[list(runs)[2]] / step["base"] - 1, 4),
                   "hooks overhead": round(step["lora artifact, base model"] / step["base"] - 1, 4)}
            results["rows"].append(row)
            print(json.dumps(row))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
