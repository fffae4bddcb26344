"""``kiln plan MODEL``: how to lay the model out over GPUs (``kiln.planner``), explained.

Reads only the model's config. Exits 0 with the plan, or 2 with the reasons no layout fits.
"""

from __future__ import annotations

import argparse
import sys


def add_parser(commands) -> None:
    from kiln.cli_compile import quantization_name
    from kiln.planner.hardware import GPUS

    p = commands.add_parser("plan", help="choose tp/pp/ep for a model on N GPUs and explain the choice",
                            description=__doc__.splitlines()[0])
    p.add_argument("model", help="artifact, HF model directory, .gguf file, or alias")
    p.add_argument("--gpus", type=int, default=1, help="GPUs available (default 1)")
    p.add_argument("--gpu", default="h100", choices=sorted(GPUS), help="the GPU's spec (default h100)")
    p.add_argument("--gpu-memory-gb", type=float, default=None, help="memory per GPU in GB (default: the GPU's)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="tp stays within a node (default 8)")
    p.add_argument("--max-seq-len", type=int, default=None, help="context per sequence (default: the model's)")
    p.add_argument("--concurrency", type=int, default=1, help="sequences at full context at once (default 1)")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"],
                   help="weights' dtype (default: an artifact's, else bf16)")
    p.add_argument("--quantization", default=None, type=quantization_name, metavar="SCHEME",
                   help="fp8, w8a8_int8, w8a16_int8 or mxfp4 (default: an artifact's, else none)")
    p.add_argument("--mem-fraction", type=float, default=None,
                   help="share of GPU memory for weights + KV (default: the engine's)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from kiln.planner import ModelShape, PlanError, PlanRequest, make_plan, model_config
    from kiln.planner.report import error_json, plan_json, plan_text

    source = model_config(args.model)
    compiled = source.compiled
    request = PlanRequest(
        gpus=args.gpus, gpu=args.gpu, gpu_memory_gb=args.gpu_memory_gb, gpus_per_node=args.gpus_per_node,
        max_seq_len=args.max_seq_len or compiled.get("max_seq_len"), concurrency=args.concurrency,
        dtype=args.dtype or compiled.get("dtype") or "bf16",
        quantization=args.quantization or compiled.get("quantization"),
        **({} if args.mem_fraction is None else {"mem_fraction": args.mem_fraction}))
    try:
        plan = make_plan(ModelShape.from_hf(source.config), request)
    except PlanError as error:
        if args.json:
            print(error_json(error))
        else:
            print(f"kiln: error: {error}", file=sys.stderr)
        return 2
    print(plan_json(plan) if args.json else plan_text(plan))
    return 0
