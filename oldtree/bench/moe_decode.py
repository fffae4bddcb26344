"""MoE decode against HF transformers eager, and the fused MoE kernel against the per-expert loop.

Shapes: Qwen3-30B-A3B (128 experts, top-8, expert MLP 768) and Mixtral-8x7B (8 experts, top-2,
expert MLP 14336), random bf16 weights, cut to ``--layers`` (default 16 and 8: HF's copy and
kiln's both fit one H200 with room for the KV cache). Per batch size, in one process on the same
weights: kiln (triton backend, decode as CUDA graphs) and HF ``generate`` eager, decode rate from
the difference of a 1-token and a 1+N-token run (as ``decode.py`` times it).

Roofline: the bytes a decode step must read at the copy bandwidth measured in the same run: every
non-expert weight but the embedding table (a step reads B of its rows), plus the experts the step
activates. At batch 1 those are exactly top-k per layer; at larger batches the expected number of
distinct experts under uniform routing, ``E * (1 - (1 - k/E)^B)`` (labelled as an estimate).

Kernel table: one layer's ``moe`` (Triton: sorted grouped GEMMs, or the per-pair GEMVs at few
pairs) against ``ref_moe`` (a loop over the chosen experts, as HF's eager MoE block runs) at several
token counts; the Triton op (and the router's top-k before it) replayed as a CUDA graph
(``do_bench_cudagraph``: launches as a decode step issues them, not Python's launch cost), the loop
with ``do_bench`` (it reads the ids on the host). ``moe TB/s`` is the bytes of the distinct experts
the tokens chose over the Triton op's time: against the copy bandwidth, how near the op is to its
roofline (the replays read the same experts with no L2 flush between them: where those are not much
larger than the L2, as Qwen3's one token's 75 MB against an H100's 50 MB, a bound from above).

    python bench/moe_decode.py --shapes qwen3-30b-a3b mixtral-8x7b --batches 1 64 --out moe.json
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import copy_bandwidth, rates, run_core, run_hf  # noqa: E402

from kiln.cli_compile import add_tuning_options, tuning_options  # noqa: E402
from kiln.compiler.compile import compile_model  # noqa: E402
from kiln.compiler.options import CompileOptions  # noqa: E402
from kiln.compiler.sources.hf import MemoryTensors, ModelSource  # noqa: E402
from kiln.runtime.engine_core import EngineCore  # noqa: E402
from kiln.runtime.engine_options import EngineOptions  # noqa: E402

# (transformers config class, model class, config, layers kept by default)
SHAPES = {
    "qwen3-30b-a3b": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=False), 16),
    "mixtral-8x7b": ("MixtralConfig", "MixtralForCausalLM", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
        rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=None, tie_word_embeddings=False), 8),
}


def random_moe_model(shape: str, layers: int | None = None, dtype: torch.dtype = torch.bfloat16,
                     device: str = "cuda", overrides: dict | None = None, seed: int = 0):
    """An HF model of ``shape`` with random weights and a kiln ``ModelSource`` over the same tensors,
    named per expert as checkpoints store them (HF holds them stacked in memory: the per-expert
    tensors are views of its stacks, so nothing is copied)."""
    import transformers

    config_cls, model_cls, base, default_layers = SHAPES[shape]
    config = getattr(transformers, config_cls)(**{**base, "num_hidden_layers": layers or default_layers,
                                                  **(overrides or {})})
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = getattr(transformers, model_cls)(config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:  # ~unit-variance outputs: std 1/sqrt(fan_in) (the last dim of every weight, stacked or not)
                p.normal_(0.0, 0.1 if "embed" in name else p.shape[-1] ** -0.5)
    model.eval()
    hf_config = {**config.to_dict(), "architectures": [model_cls]}
    tensors = checkpoint_names(model.state_dict(), model_cls)
    fingerprint = hashlib.sha256(f"{shape}:{layers}:{seed}:{dtype}:{overrides}".encode()).hexdigest()[:16]
    return model, ModelSource(Path(f"<random {shape}>"), hf_config, MemoryTensors(tensors), (), fingerprint)


def checkpoint_names(state: dict[str, torch.Tensor], model_cls: str) -> dict[str, torch.Tensor]:
    """HF's in-memory stacks (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``)
    as the per-expert tensors a checkpoint holds, under the checkpoint's names."""
    mixtral = model_cls == "MixtralForCausalLM"
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    out = {}
    for name, tensor in state.items():
        if mixtral:  # HF renames Mixtral's block_sparse_moe to mlp when it loads a checkpoint
            name = name.replace(".mlp.", ".block_sparse_moe.")
        if name.endswith(".experts.gate_up_proj"):
            prefix, inter = name[:-len("gate_up_proj")], tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{prefix}{e}.{gate}.weight"] = tensor[e, :inter]
                out[f"{prefix}{e}.{up}.weight"] = tensor[e, inter:]
        elif name.endswith(".experts.down_proj"):
            prefix = name[:-len("down_proj")]
            for e in range(tensor.shape[0]):
                out[f"{prefix}{e}.{down}.weight"] = tensor[e]
        else:
            out[name] = tensor
    return out


def step_bytes(state: dict[str, torch.Tensor], experts: int, top_k: int, batch: int) -> tuple[float, bool]:
    """Bytes one decode step reads (see the module doc) and whether the expert part is exact."""
    expert_bytes = sum(t.numel() * t.element_size() for n, t in state.items() if ".experts." in n)
    other = sum(t.numel() * t.element_size() for n, t in state.items()
                if ".experts." not in n and "embed_tokens" not in n)
    active = experts * (1 - (1 - top_k / experts) ** batch) if batch > 1 else top_k
    return other + expert_bytes * active / experts, batch == 1


def bench_shape(shape: str, args: argparse.Namespace, bandwidth: float, log) -> list[dict]:
    model, source = random_moe_model(shape, args.layers)
    config = source.config
    experts = int(config.get("num_local_experts") or config["num_experts"])
    top_k = int(config["num_experts_per_tok"])
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
        prompts = torch.randint(0, config["vocab_size"], (batch, args.prompt_len), generator=generator)
        read, exact = step_bytes(model.state_dict(), experts, top_k, batch)
        row = {"shape": shape, "layers": config["num_hidden_layers"], "batch": batch, "step_GB": read / 1e9,
               "roofline_ms": 1e3 * read / bandwidth, "roofline_exact": exact}
        row["kiln"] = rates(lambda n: run_core(core, [p.tolist() for p in prompts], n), batch, args.prompt_len,
                            args.new_tokens)
        row["hf_eager"], row["hf_experts"] = hf_rates(model, prompts.cuda(), args)
        log(json.dumps(row))
        rows.append(row)
    del core, model
    gc.collect()  # the core's reference cycles hold its weights and KV pages until collected
    torch.cuda.empty_cache()
    return rows


def hf_rates(model, prompts: torch.Tensor, args: argparse.Namespace) -> tuple[dict, str]:
    """HF eager's rates and the experts implementation they ran. HF's ``generate`` decodes with
    ``batched_mm``, which gathers every chosen expert's weights per token (28 GB a layer for Mixtral at
    batch 64); where that runs out of memory, the rates are the per-expert loop's (``eager``)."""
    def measure() -> dict:
        return rates(lambda n: run_hf(model, prompts, n, False), len(prompts), args.prompt_len, args.new_tokens)

    try:
        return measure(), "batched_mm"
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
    previous = model.get_experts_implementation()
    model.set_experts_implementation("eager")
    try:
        return measure(), "eager (batched_mm ran out of memory)"
    finally:
        model.set_experts_implementation(previous)


def kernel_rows(shape: str, token_counts: list[int]) -> list[dict]:
    """One layer's moe op: the Triton launcher against the per-expert loop, bf16, random routing."""
    from triton.testing import do_bench, do_bench_cudagraph

    from kiln.kernels.moe import ref_moe, ref_router_topk
    from kiln.kernels.moe_gemm import triton_moe
    from kiln.kernels.moe_routing import triton_router_topk

    _, _, config, _ = SHAPES[shape]
    experts = config.get("num_local_experts") or config["num_experts"]
    top_k, hidden = config["num_experts_per_tok"], config["hidden_size"]
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    w_gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * hidden ** -0.5
    w_down = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) * inter ** -0.5
    rows = []
    for tokens in token_counts:
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16)
        weights, ids = ref_router_topk(logits, top_k, renormalize=True)
        out = torch.empty_like(x)
        fused = do_bench_cudagraph(lambda: triton_moe(x, weights, ids, w_gate_up, w_down, out=out))
        router = do_bench_cudagraph(lambda: triton_router_topk(logits, out=(weights, ids), top_k=top_k,
                                                               renormalize=True))
        loop = do_bench(lambda: ref_moe(x, weights, ids, w_gate_up, w_down))
        expert_bytes = (w_gate_up[0].numel() + w_down[0].numel()) * w_down.element_size()
        read = torch.unique(ids).numel() * expert_bytes
        rows.append({"shape": shape, "tokens": tokens, "fused_ms": fused, "loop_ms": loop, "router_topk_ms": router,
                     "moe_TBps": read / fused / 1e9})
    return rows


def tables(rows: list[dict], kernels: list[dict], bandwidth: float) -> str:
    lines = [f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; {torch.cuda.get_device_name()}",
             "| shape (layers) | batch | kiln ms/step | roofline ms/step | kiln % of roofline | kiln tok/s | "
             "HF eager tok/s | HF experts | kiln / HF eager |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kiln, eager = r["kiln"], r["hf_eager"]
        estimate = "" if r["roofline_exact"] else " (est.)"
        lines.append(f"| {r['shape']} ({r['layers']}) | {r['batch']} | {kiln['ms_per_step']:.3f} | "
                     f"{r['roofline_ms']:.3f}{estimate} | {100 * r['roofline_ms'] / kiln['ms_per_step']:.0f}% | "
                     f"{kiln['decode_tok_s']:.0f} | {eager['decode_tok_s']:.0f} | {r['hf_experts']} | "
                     f"{kiln['decode_tok_s'] / eager['decode_tok_s']:.1f}x |")
    lines += ["", "| shape | tokens | fused moe ms | moe TB/s | router top-k ms | per-expert loop ms | speed-up |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {k['shape']} | {k['tokens']} | {k['fused_ms']:.4f} | {k['moe_TBps']:.2f} | "
              f"{k['router_topk_ms']:.4f} | {k['loop_ms']:.3f} | {k['loop_ms'] / k['fused_ms']:.1f}x |" for k in kernels]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=sorted(SHAPES), choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="layers kept (default: 16 for Qwen3, 8 for Mixtral)")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--kernel-tokens", nargs="+", type=int, default=[1, 8, 64, 512])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    add_tuning_options(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/moe_decode.py needs a CUDA GPU")
    bandwidth = copy_bandwidth()
    rows, kernels = [], []
    for shape in args.shapes:
        rows += bench_shape(shape, args, bandwidth, lambda line: print(line, flush=True))
        kernels += kernel_rows(shape, args.kernel_tokens)
    print(tables(rows, kernels, bandwidth))
    if args.out:
        args.out.write_text(json.dumps({"bandwidth": bandwidth, "rows": rows, "kernels": kernels,
                                        "args": vars(args) | {"out": str(args.out)}}, indent=1))


if __name__ == "__main__":
    main()
