"""Disaggregated prefill and decode against one mixed server, on a long-prompt workload (issue 26).

Starts, one after the other, the two layouts of the same artifact and drives each with
``bench/serving.py``'s load (same prompts, same seed): ``mixed``, one ``kiln serve`` on one device;
``disaggregated``, a ``--disaggregation-mode prefill`` server, a ``--disaggregation-mode decode``
server (each on its own device: ``CUDA_VISIBLE_DEVICES`` per server on GPUs) and ``kiln router
--pd-disaggregation`` in front. Prints TTFT and TPOT percentiles and output throughput of each, and
writes both summaries as JSON (``--out``).

Issue 26's run (two GPUs: the mixed server on GPU 0; prefill on GPU 0, decode on GPU 1), on the
Llama-3-8B shape's random bf16 weights with any tokenizer directory (SmolLM2's here):

    TOK=$(python -c "from kiln.compiler.sources.aliases import resolve_model as r; print(r('smollm2-135m-instruct'))")
    python bench/offline.py --shape llama3-8b --tokenizer-dir $TOK --save-artifact /tmp/l8b.kiln \
        --max-seq-len 8192 --max-batch-tokens 8192 --workload random --num-requests 2 --input-len 4096 --output-len 4
    python bench/disagg.py /tmp/l8b.kiln --gpus 0,1 --num-prompts 128 --input-len 4096 --range-ratio 0.5 \
        --output-len 256 --ignore-eos --request-rate 2 --max-concurrency 32 --out /tmp/disagg-l8b.json

A smoke run on the CPU (tests/bench/test_disagg.py does this on a tiny model):

    python bench/disagg.py ART --device cpu --num-prompts 6 --input-len 96 --output-len 8 --ignore-eos
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving  # noqa: E402

START_TIMEOUT_S = 900


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def process(command: list[str], log: Path, gpu: str | None) -> Iterator[subprocess.Popen]:
    """``command`` running (on GPU ``gpu`` alone when given), stopped with SIGTERM at the end."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else None
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_healthy(url: str, procs: list[subprocess.Popen], logs: list[Path]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        for proc, log in zip(procs, logs):
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(proc.args[:4])} exited with {proc.returncode}:\n"
                                   f"{log.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not become healthy in {START_TIMEOUT_S} s")


def serve_command(args: argparse.Namespace, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kiln", "serve", args.artifact, "--port", str(port), "--device", args.device,
            "--served-model-name", args.served_model_name, *args.serve_args.split(), *extra]


def run_layout(args: argparse.Namespace, load: list[str], layout: str, logs: Path) -> dict:
    gpus = args.gpus.split(",") if args.device == "cuda" else [None, None]
    with ExitStack() as stack:
        if layout == "mixed":
            port = free_port()
            log = logs / "mixed.log"
            procs, watched = [stack.enter_context(process(serve_command(args, port), log, gpus[0]))], [log]
        else:
            prefill, decode, port, bootstrap = free_port(), free_port(), free_port(), free_port()
            watched = [logs / "prefill.log", logs / "decode.log", logs / "router.log"]
            procs = [
                stack.enter_context(process(serve_command(args, prefill, "--disaggregation-mode", "prefill",
                                                          "--disaggregation-bootstrap-port", str(bootstrap)),
                                            watched[0], gpus[0])),
                stack.enter_context(process(serve_command(args, decode, "--disaggregation-mode", "decode"),
                                            watched[1], gpus[1])),
                stack.enter_context(process(
                    [sys.executable, "-m", "kiln", "router", "--pd-disaggregation", "--prefill",
                     f"http://127.0.0.1:{prefill}", str(bootstrap), "--decode", f"http://127.0.0.1:{decode}",
                     "--port", str(port)], watched[2], None))]
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, procs, watched)
        return serving.run(serving.parse_args([*load, "--base-url", url, "--model", args.served_model_name]))


def comparison(results: dict[str, dict]) -> str:
    lines = [f"{'layout':<16}{'out tok/s':>10}" + "".join(f"{f'{n} {p}':>12}" for n in ("TTFT", "TPOT")
                                                         for p in ("p50", "p90", "p99")) + "  (ms)"]
    for layout, summary in results.items():
        lines.append(f"{layout:<16}{summary['output_throughput']:>10.1f}" +
                     "".join(f"{summary[f'{n}_ms'][p]:>12.1f}" for n in ("ttft", "tpot") for p in ("p50", "p90", "p99")))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Other options (--num-prompts, --input-len, --output-len, --max-concurrency, "
                                       "--request-rate, --ignore-eos, --seed, ...) go to bench/serving.py.")
    p.add_argument("artifact", help="a compiled artifact (both layouts serve it)")
    p.add_argument("--served-model-name", default="m")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--gpus", default="0,1", help="GPU of the mixed and prefill servers, GPU of the decode server")
    p.add_argument("--serve-args", default="", help="more `kiln serve` options for every server, one string")
    p.add_argument("--layouts", default="mixed,disaggregated")
    p.add_argument("--out", default=None, help="write both summaries as JSON here")
    return p.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, load = parse_args(argv)
    logs = Path(args.out).parent if args.out else Path(".")
    results = {layout: run_layout(args, load, layout, logs) for layout in args.layouts.split(",")}
    print(comparison(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
