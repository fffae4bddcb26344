"""``kiln serve`` (the OpenAI-compatible server, compiling a model on first use; a node > 0 of a
multi-node group runs only its ranks) and ``kiln router`` (SGLang's prefill/decode router)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kiln.cli_compile import add_compile_options, compile_options_from


def add_serve_parser(commands) -> None:
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
    p.add_argument("--stream-interval", type=int, default=1,
                   help="a streaming sample's text arrives every this many tokens, its first token at once (SGLang's "
                        "name): fewer, larger chunks for less server CPU a token at high concurrency (default 1)")
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
    p.add_argument("--grammar-threads", type=int, default=None,
                   help="most threads that fill a step's structured-output token masks "
                        "(default: half the CPUs, at most 8)")
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
    if args.stream_interval < 1:
        raise ValueError(f"--stream-interval: must be at least 1, got {args.stream_interval}")
    if args.grammar_threads is not None and args.grammar_threads < 1:
        raise ValueError(f"--grammar-threads: must be at least 1, got {args.grammar_threads}")
    engine = {"device": args.device, "kv_cache_tokens": args.kv_cache_tokens, "mem_fraction": args.mem_fraction,
              "max_batch_tokens": args.max_batch_tokens, "schedule_policy": args.schedule_policy,
              "world_size": args.world_size, "reference_fallback": args.reference_fallback,
              "debug_fail_token_id": args.debug_fail_token_id, "nnodes": args.nnodes,
              "grammar_threads": args.grammar_threads,
              "dist_init_addr": args.dist_init_addr, **speculative}
    if args.disaggregation_mode != "null":  # refused before any process starts
        from kiln.server.launch import check_disaggregation
        from kiln.server.serve_config import ServeConfig

        check_disaggregation(str(artifact), ServeConfig(engine=engine, dp=args.dp,
                                                        lora_modules=dict(args.lora_modules)))
    # The model loads in the children while this process imports its web stack (launch).
    started = start_processes(str(artifact), args.host, args.port, args.dp, engine, dict(args.lora_modules),
                              args.log_level, args.disaggregation_mode, args.disaggregation_bootstrap_port,
                              args.api_server_count, args.stream_interval)
    if started is None:
        exit_now(1)
    with startup.phase("server_imports"):
        from kiln.server.launch import serve
        from kiln.server.serve_config import ServeConfig
        from kiln.server.tokenizer_manager import Admission
    config = ServeConfig(
        host=args.host, port=args.port, api_key=args.api_key,
        served_model_name=args.served_model_name or artifact_model_name(artifact),
        max_body_bytes=args.max_body_bytes, max_n=args.max_n, drain_timeout=args.drain_timeout,
        log_level=args.log_level, tool_call_parser=args.tool_call_parser, grpc_port=args.grpc_port,
        engine=engine, dp=args.dp, admission=Admission(args.max_queued_requests),
        lora_modules=dict(args.lora_modules), disaggregation_mode=args.disaggregation_mode,
        bootstrap_port=args.disaggregation_bootstrap_port, api_server_count=args.api_server_count,
        stream_interval=args.stream_interval)
    # Its child processes are gone; the interpreter's teardown would only delay a prompt exit.
    exit_now(serve(str(artifact), config, startup, started))


def add_router_parser(commands) -> None:
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
