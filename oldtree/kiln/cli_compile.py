"""``kiln compile``, and the compile and tuning options that ``serve``, ``generate``, ``chat`` and the
benchmarks share: the flags, and the ``CompileOptions`` and kernel tuning they turn into."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kiln.lora_layout import TARGET_MODULES


def add_parser(commands) -> None:
    p = commands.add_parser("compile", help="compile a model (HF dir, GGUF file or alias) into an artifact")
    p.add_argument("model", help="HF model directory, .gguf file, or alias such as smollm2-135m-instruct")
    p.add_argument("-o", "--output", required=True, type=Path, help="artifact directory to write (NAME.kiln)")
    add_compile_options(p)
    p.add_argument("--dump-ir", type=Path, default=None, help="write the IR after each pass into this directory")
    p.add_argument("--warm", action="store_true",
                   help="then load it once on this machine's GPU, saving the Triton kernels compiled for it into the "
                        "artifact (kernels/triton-<version>-<arch>/), so that serving it compiles none")
    add_tuning_options(p)
    p.set_defaults(run=_run_compile)


def add_compile_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--backend", default=None, choices=["torch", "triton"],
                   help="kernel backend (default: triton when a GPU is present, else torch)")
    p.add_argument("--max-batch-tokens", type=int, default=2048, help="tokens in one step (default 2048)")
    p.add_argument("--max-batch-size", type=int, default=256, help="sequences in one step (default 256)")
    p.add_argument("--max-seq-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--max-logit-rows", type=int, default=None,
                   help="rows of logits one step returns (default: --max-batch-size; with speculative decoding, "
                        "--max-batch-size x the tokens a request verifies, which a model compiled by kiln serve "
                        "gets by itself)")
    p.add_argument("--page-size", type=int, default=16, help="KV cache page size in tokens (default 16)")
    p.add_argument("--quantization", default=None, type=quantization_name, metavar="SCHEME",
                   help="quantize the GEMMs' weights: fp8, w8a8_int8, w8a16_int8 or mxfp4 (default: none)")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="with --quantization (or a pre-quantized checkpoint): quantize the lm_head too, which "
                        "otherwise stays in the model's dtype (a tied one gets a quantized copy)")
    p.add_argument("--tp", type=_rank_count("--tp"), default=1,
                   help="tensor-parallel ranks: the artifact holds one weights shard per rank, and serving it "
                        "starts every rank; auto: the planner's choice for the GPUs (kiln plan) (default 1)")
    p.add_argument("--pp", type=_rank_count("--pp"), default=None,
                   help="pipeline stages: the layers split into this many stages of --tp ranks each, which "
                        "overlap on micro-batches; serving starts tp x pp ranks; auto: the planner's (default 1, "
                        "or the planner's with --tp auto)")
    p.add_argument("--gpus", type=int, default=None,
                   help="for --tp auto: the GPUs to plan for (default: this machine's; one without any)")
    p.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="for --tp auto: memory per GPU in GB (default: the first GPU's, else an H100's)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel ranks for a mixture-of-experts model: its routed experts partitioned "
                        "over them, inside --tp (with --tp 1, or --tp a multiple of --ep; default 1)")
    p.add_argument("--expert-load", type=Path, default=None, metavar="FILE",
                   help="measured tokens per expert, a JSON object of layer -> counts (the expert_load kiln bench "
                        "offline --out records): with --redundant-experts, copies of the hottest experts are placed "
                        "so that the --ep ranks share the tokens evenly (EPLB-style)")
    p.add_argument("--redundant-experts", type=int, default=0,
                   help="extra expert slots per sparse layer for --expert-load's placement (default 0)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"],
                   help="the KV cache's dtype: auto (the model's) or fp8_e4m3 (half the bytes a token, per-tensor "
                        "scales of 1.0)")
    p.add_argument("--max-loras", type=int, default=None,
                   help="LoRA adapter slots on the device (default: 1 with --lora-modules, else no LoRA)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="largest LoRA adapter rank served (default 16)")
    p.add_argument("--lora-target-modules", nargs="+", default=list(TARGET_MODULES), metavar="MODULE",
                   help=f"projections that take LoRA adapters (default: {' '.join(TARGET_MODULES)})")


def add_tuning_options(p: argparse.ArgumentParser, skip_pass: bool = True) -> None:
    """``--kernel-config NAME=VALUE`` and (unless ``skip_pass`` is off) ``--skip-pass NAME``, for
    ``kiln compile`` and the benchmarks. Each is checked as it is parsed: a name that is no
    ``KernelConfig`` field or no pass is an error listing the valid ones."""
    p.add_argument("--kernel-config", action="append", default=[], type=_kernel_setting, metavar="NAME=VALUE",
                   help="set a kernel tunable (a KernelConfig field, e.g. decode_block_n=32 or pdl=false; "
                        "repeatable); the artifact records it")
    if skip_pass:
        p.add_argument("--skip-pass", action="append", default=[], type=_pass_name, metavar="NAME",
                       help="compile without this pass of the pipeline, for experiments (repeatable)")


def tuning_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``CompileOptions`` fields ``add_tuning_options``'s arguments set."""
    from kiln.kernels.config import DEFAULTS

    return {"kernel_config": DEFAULTS.with_settings(dict(args.kernel_config)),
            "skip_passes": tuple(getattr(args, "skip_pass", ()))}


def _kernel_setting(text: str) -> tuple[str, Any]:
    from kiln.kernels.config import DEFAULTS, KernelConfigError, parse_settings

    try:
        (name, value), = parse_settings([text]).items()
        DEFAULTS.with_settings({name: value})
    except KernelConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name, value


def quantization_name(name: str) -> str:
    from kiln.compiler.quantization import get_method

    try:
        get_method(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name


def _rank_count(flag: str):
    def parse(text: str) -> int | str:
        from kiln.planner.auto import parse_count

        try:
            return parse_count(text, flag)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _pass_name(name: str) -> str:
    from kiln.compiler.pipeline import selected_passes

    try:
        selected_passes([name])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name


def compile_options_from(args: argparse.Namespace):
    from kiln.artifact_cache import is_artifact
    from kiln.compiler.options import CompileOptions
    from kiln.planner.auto import LayoutHints, resolve_layout

    backend = args.backend
    if backend is None:
        import torch

        backend = "triton" if torch.cuda.is_available() else "torch"
    # An artifact runs on the ranks it was compiled for; a model is compiled for tp x pp of them.
    tp, pp = 1, 1
    if not is_artifact(args.model):
        layout = resolve_layout(args.model, args.tp, args.pp, LayoutHints(
            args.gpus, args.gpu_memory_gb, args.dtype, args.quantization, args.max_seq_len))
        tp, pp = layout.tp, layout.pp
        if layout.reason:
            print(f"kiln: {layout.reason}", file=sys.stderr)
    lora_modules = getattr(args, "lora_modules", None)
    max_loras = args.max_loras if args.max_loras is not None else (1 if lora_modules else 0)
    return CompileOptions(dtype=args.dtype, backend=backend, max_batch_tokens=args.max_batch_tokens,
                          max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
                          max_logit_rows=args.max_logit_rows, page_size=args.page_size,
                          quantization=args.quantization, quantize_lm_head=args.quantize_lm_head,
                          kv_cache_dtype=args.kv_cache_dtype, tp=tp, pp=pp,
                          ep=args.ep, expert_placement=_expert_placement(args),
                          max_loras=max_loras, max_lora_rank=args.max_lora_rank,
                          lora_target_modules=tuple(args.lora_target_modules))


def _expert_placement(args: argparse.Namespace) -> tuple:
    """``--expert-load`` and ``--redundant-experts`` as ``CompileOptions.expert_placement``."""
    if args.expert_load is None:
        if args.redundant_experts:
            raise ValueError("--redundant-experts places copies by measured load: give --expert-load FILE too")
        return ()
    from kiln.compiler.expert_placement import placements_from_loads, read_loads

    return placements_from_loads(read_loads(args.expert_load), args.redundant_experts, args.ep)


def _run_compile(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from kiln.compiler.compile import compile_model

    options = replace(compile_options_from(args), **tuning_options(args))
    if args.warm:
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--warm compiles the Triton kernels for this machine's GPU, and it has none")
    out = compile_model(args.model, args.output, options, dump_ir=args.dump_ir)
    print(f"wrote {out}")
    if args.warm:
        from kiln.runtime.engine_core import EngineCore
        from kiln.runtime.engine_options import EngineOptions

        # Loading runs every decode graph's warm-up, which compiles the kernels; close() saves them.
        EngineCore(str(out), EngineOptions(device="cuda")).close()
        print(f"saved its Triton kernels for this GPU into {out / 'kernels'}")
    return 0
