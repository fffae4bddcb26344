"""Random-weight models of real shapes for GPU benchmarks and tests, built in GPU memory.

``random_model(shape, layers=None)`` returns an HF model (random weights, scaled so logits have
clear margins) and a kiln ``ModelSource`` over the same tensors, so kiln and HF run identical
weights without a checkpoint round trip through the disk. ``random_engine`` compiles one for the
triton backend (with the ``--kernel-config`` and ``--skip-pass`` of ``add_model_arguments``) and
loads it into an ``EngineCore``, as the breakdown benchmarks run it. ``random_artifact`` writes one
to disk with a tokenizer beside it, for ``kiln serve`` and ``kiln.Engine``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import tempfile
from pathlib import Path

import torch

from kiln.cli_compile import add_tuning_options, tuning_options
from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.compiler.sources.hf import TOKENIZER_FILES, MemoryTensors, ModelSource
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.engine_options import EngineOptions

SHAPES = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                      rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True),
}


def random_model(shape: str, dtype: torch.dtype = torch.bfloat16, layers: int | None = None, seed: int = 0,
                 device: str = "cuda", vocab_size: int | None = None):
    from transformers import LlamaConfig, LlamaForCausalLM

    overrides = {"num_hidden_layers": layers} if layers else {}
    if vocab_size:
        overrides["vocab_size"] = vocab_size
    config = LlamaConfig(**{**SHAPES[shape], **overrides})
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the target dtype: an f32 Llama-3-8B would need 32 GB first
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        hidden = config.hidden_size
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                # ~unit-variance layer outputs (std 1/sqrt(fan_in)); small embeddings, so a tied head does not
                # just echo the input token back.
                p.normal_(0.0, 0.1 if "embed" in name else (p.shape[1] if p.dim() == 2 else hidden) ** -0.5)
    model.eval()
    hf_config = config.to_dict()
    hf_config["architectures"] = ["LlamaForCausalLM"]
    tensors = {name: t for name, t in model.state_dict().items()
               if not (config.tie_word_embeddings and name == "lm_head.weight")}
    fingerprint = hashlib.sha256(f"{shape}:{layers}:{seed}:{dtype}:{vocab_size}".encode()).hexdigest()[:16]
    return model, ModelSource(Path(f"<random {shape}>"), hf_config, MemoryTensors(tensors), (), fingerprint)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments ``random_engine`` reads: the shape, its layers, the batch of prompts, and the
    compile's quantization, kernel config and skipped passes."""
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="cut the shape to this many layers")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--quantization", default=None, help="compile with this quantization method (e.g. fp8)")
    add_tuning_options(parser)


def random_engine(args: argparse.Namespace, max_seq_len: int, **options) -> EngineCore:
    """An engine on the GPU over a random ``args.shape`` model in bf16, compiled for the triton backend
    with room for ``args.batch`` prompts of ``args.prompt_len`` tokens, prefix cache off (every
    request computes its whole prompt); ``options`` are further ``EngineOptions``."""
    _, source = random_model(args.shape, layers=args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        artifact = compile_model(source, Path(tmp) / "m.kiln", CompileOptions(
            dtype="bf16", backend="triton", max_batch_tokens=max(512, args.batch * args.prompt_len),
            max_batch_size=args.batch, max_seq_len=max_seq_len, quantization=args.quantization,
            **tuning_options(args)))
        return EngineCore(str(artifact), EngineOptions(device="cuda", kv_cache_tokens=args.batch * 1024,
                                                       enable_prefix_cache=False, **options))


def random_artifact(shape: str, out: Path, on_gpu: bool, tokenizer_dir: Path | None = None, layers: int | None = None,
                    max_seq_len: int = 2048) -> Path:
    """An artifact at ``out`` of random ``shape`` weights (bf16 and triton on a GPU, fp32 and torch on the
    CPU), with the tokenizer files found in ``tokenizer_dir`` when given."""
    _, source = random_model(shape, dtype=torch.bfloat16 if on_gpu else torch.float32, layers=layers,
                             device="cuda" if on_gpu else "cpu")
    if tokenizer_dir is not None:
        files = tuple(tokenizer_dir / n for n in TOKENIZER_FILES if (tokenizer_dir / n).is_file())
        source = dataclasses.replace(source, tokenizer_files=files)
    return compile_model(source, out, CompileOptions(dtype="bf16" if on_gpu else "fp32",
                                                     backend="triton" if on_gpu else "torch", max_seq_len=max_seq_len))
