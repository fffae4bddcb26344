"""The ``kiln`` command line: compile, fetch, generate, chat, serve, bench.

Expected failures (a bad path, an unsupported architecture, an invalid option) print one line
``kiln: error: ...`` and exit with status 2; only unexpected ones show a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kiln.lora_layout import TARGET_MODULES
from kiln.runtime.worker.nccl_env import keep_multicast_off

EXPECTED_ERRORS = (ValueError, FileNotFoundError, FileExistsError, LookupError)


def main(argv: list[str] | None = None) -> int:
    keep_multicast_off()  # before any process or communicator kiln makes: they inherit it
    parser = argparse.ArgumentParser(prog="kiln", description="Compile, serve and benchmark LLMs.")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_compile(commands)
    _add_fetch(commands)
    from kiln import cli_bench, cli_generate, cli_plan

    cli_generate.add_parsers(commands)
    cli_bench.add_parser(commands)
    cli_plan.add_parser(commands)
    _add_serve(commands)
    _add_router(commands)
    args = parser.parse_args(argv)
    try:
        return args.run(args) or 0
    except EXPECTED_ERRORS as exc:
        print(f"kiln: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _add_compile(commands) -> None:
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
    p.add_argument("--quantization", default=None, type=_quantization, metavar="SCHEME",
                   help="quantize the GEMMs' weights: fp8, w8a8_int8, w8a16_int8 or mxfp4 (default: none)")
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


def _quantization(name: str) -> str:
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
                          quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, tp=tp, pp=pp,
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


def _add_fetch(commands) -> None:
    p = commands.add_parser("fetch", help="obtain a model by alias into the cache (KILN_HOME)")
    p.add_argument("alias", help="e.g. smollm2-135m-instruct")
    p.set_defaults(run=_run_fetch)


def _run_fetch(args: argparse.Namespace) -> int:
    from kiln.compiler.sources.aliases import fetch

    print(fetch(args.alias))
    return 0


def _add_serve(commands) -> None:
    from kiln.cli_speculative import add_speculative_arguments

    p = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model", help="artifact directory, or a model to compile on first use (HF dir, GGUF, alias)")
    add_compile_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY (not on /health)")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: the model's own name, an alias or its "
                        "source directory's name, as recorded in the artifact)")
    p.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024, help="largest request body (default 8 MiB)")
    p.add_argument("--max-n", type=int, default=16, help="most samples one request may ask for (default 16)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for requests in flight (default 30)")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when present")
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="KV pool size in tokens")
    p.add_argument("--mem-fraction", type=float, default=0.85, help="GPU memory for weights + KV (default 0.85)")
    p.add_argument("--schedule-policy", default="lpm", choices=["lpm", "fcfs"])
    p.add_argument("--world-size", type=int, default=1,
                   help="ranks to run a one-rank artifact on, each a full copy in its own process after the first "
                        "(default 1; a tensor- or expert-parallel artifact runs on its own max(--tp, --ep) ranks)")
    p.add_argument("--dp", type=int, default=1,
                   help="data-parallel replicas, each its own scheduler process, engine and KV cache (on GPUs its "
                        "own devices), behind one endpoint with a cache-aware router (default 1)")
    p.add_argument("--api-server-count", type=int, default=1,
                   help="HTTP processes on the port (vLLM's name), each with its own tokenizer manager, all sending "
                        "to the same scheduler(s): more when one HTTP process is the bottleneck (default 1)")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="most requests waiting beyond those running; more get 503 with Retry-After (default: no limit)")
    p.add_argument("--nnodes", type=int, default=1,
                   help="machines the ranks are spread over: each runs a consecutive 1/--nnodes share of the "
                        "tp x pp ranks (default 1)")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this machine's node (default 0): node 0 serves, nodes > 0 run only their ranks")
    p.add_argument("--dist-init-addr", default=None, metavar="HOST:PORT",
                   help="node 0's rendezvous address, the same on every node (needed with --nnodes > 1)")
    p.add_argument("--disaggregation-mode", default="null", choices=["null", "prefill", "decode"],
                   help="prefill/decode disaggregation (docs/distributed.md): this server only prefills and hands "
                        "the KV pages over, or only decodes requests whose pages it is handed; behind "
                        "`kiln router --pd-disaggregation` (default null: both)")
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=8998,
                   help="the prefill server's port where its decode server connects for the KV handoff (default 8998)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--reference-fallback", action="store_true",
                   help="on a GPU that cannot run the model's FP8 (compute capability < 8.9), run the torch "
                        "reference kernels (slow) instead of refusing")
    add_speculative_arguments(p)
    # Fault injection for tests (EngineOptions.debug_fail_token_id); not for serving.
    p.add_argument("--debug-fail-token-id", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3", "mistral", "pythonic"],
                   help="how the model writes tool calls (default: from its chat template; hermes for the built-in one)")
    p.add_argument("--lora-modules", nargs="+", default=[], type=_lora_module, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) to serve from the start; a request picks one with "
                        "\"model\": NAME; more load at run time through POST /v1/load_lora_adapter")
    p.add_argument("--grpc-port", type=int, default=None,
                   help="also serve the gRPC API (kiln/server/grpc/kiln.proto) on this port")
    p.set_defaults(run=_run_serve)


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules takes NAME=PATH, got {text!r}")
    return name, path


def _run_serve(args: argparse.Namespace) -> int:
    import logging
    import time

    from kiln.artifact_cache import artifact_model_name, ensure_model_artifacts, is_artifact
    from kiln.cli_speculative import speculative_keywords
    from kiln.runtime.startup import process_phases
    from kiln.server.children import start_processes
    from kiln.server.ipc import exit_now

    startup = process_phases("http", time.time())
    logging.basicConfig(level=args.log_level.upper(), format="kiln: %(message)s")
    if args.device == "cpu" and args.backend is None:
        args.backend = "torch"  # Triton kernels need a GPU
    speculative = speculative_keywords(args)
    with startup.phase("artifact"):
        # An artifact is served as it is: its compile options (which import the compiler) are not needed
        # (unless a draft model must be compiled beside it).
        if is_artifact(args.model) and args.speculative_draft_model_path is None:
            artifact, draft = Path(args.model), None
        else:
            artifact, draft = ensure_model_artifacts(args.model, compile_options_from(args), speculative)
    if draft is not None:
        speculative["speculative_draft_model_path"] = draft
    if args.nnodes > 1 and args.dp > 1:
        raise ValueError("--dp: data-parallel replicas run on one node; with --nnodes > 1 leave --dp at 1")
    if args.node_rank > 0:
        return _run_node(str(artifact), args)
    engine = {"device": args.device, "kv_cache_tokens": args.kv_cache_tokens, "mem_fraction": args.mem_fraction,
              "max_batch_tokens": args.max_batch_tokens, "schedule_policy": args.schedule_policy,
              "world_size": args.world_size, "reference_fallback": args.reference_fallback,
              "debug_fail_token_id": args.debug_fail_token_id, "nnodes": args.nnodes,
              "dist_init_addr": args.dist_init_addr, **speculative}
    if args.disaggregation_mode != "null":  # refused before any process starts
        from kiln.server.launch import ServeConfig, check_disaggregation

        check_disaggregation(str(artifact), ServeConfig(engine=engine, dp=args.dp,
                                                        lora_modules=dict(args.lora_modules)))
    # The model loads in the children while this process imports its web stack (launch).
    started = start_processes(str(artifact), args.host, args.port, args.dp, engine, dict(args.lora_modules),
                              args.log_level, args.disaggregation_mode, args.disaggregation_bootstrap_port,
                              args.api_server_count)
    if started is None:
        exit_now(1)
    with startup.phase("server_imports"):
        from kiln.server.launch import ServeConfig, serve
        from kiln.server.tokenizer_manager import Admission
    config = ServeConfig(
        host=args.host, port=args.port, api_key=args.api_key,
        served_model_name=args.served_model_name or artifact_model_name(artifact),
        max_body_bytes=args.max_body_bytes, max_n=args.max_n, drain_timeout=args.drain_timeout,
        log_level=args.log_level, tool_call_parser=args.tool_call_parser, grpc_port=args.grpc_port,
        engine=engine, dp=args.dp, admission=Admission(args.max_queued_requests),
        lora_modules=dict(args.lora_modules), disaggregation_mode=args.disaggregation_mode,
        bootstrap_port=args.disaggregation_bootstrap_port, api_server_count=args.api_server_count)
    # Its child processes are gone; the interpreter's teardown would only delay a prompt exit.
    exit_now(serve(str(artifact), config, startup, started))


def _add_router(commands) -> None:
    p = commands.add_parser("router", help="SGLang's PD router: one endpoint in front of a prefill and a decode server")
    p.add_argument("--pd-disaggregation", action="store_true", required=True,
                   help="route each request to a prefill and a decode server (the only mode)")
    p.add_argument("--prefill", nargs="+", required=True, metavar=("URL", "BOOTSTRAP_PORT"),
                   help="the prefill server's URL and its --disaggregation-bootstrap-port (default 8998)")
    p.add_argument("--decode", required=True, metavar="URL", help="the decode server's URL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.set_defaults(run=_run_router)


def _run_router(args: argparse.Namespace) -> int:
    import uvicorn

    from kiln.server.pd_router import DEFAULT_BOOTSTRAP_PORT, build_router_app

    if len(args.prefill) > 2 or (len(args.prefill) == 2 and not args.prefill[1].isdigit()):
        raise ValueError(f"--prefill: expected URL [BOOTSTRAP_PORT], got {' '.join(args.prefill)}")
    port = int(args.prefill[1]) if len(args.prefill) == 2 else DEFAULT_BOOTSTRAP_PORT
    app = build_router_app(args.prefill[0].rstrip("/"), port, args.decode.rstrip("/"))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def _run_node(artifact: str, args: argparse.Namespace) -> int:
    """A node > 0 of a multi-node group: only its ranks, no server (runtime/worker/node_process.py)."""
    import logging

    import torch

    from kiln.runtime.worker.node_process import run_node
    from kiln.runtime.worker.nodes import check_layout

    check_layout(None, args.nnodes, args.node_rank, args.dist_init_addr)
    logging.basicConfig(level=args.log_level.upper(), format="kiln: %(message)s")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return run_node(artifact, device, args.nnodes, args.node_rank, args.dist_init_addr)


if __name__ == "__main__":
    sys.exit(main())
