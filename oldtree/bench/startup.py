"""Cold-start benchmark: how long ``kiln serve ART`` takes to answer ``/health``, and where it goes.

Starts ``kiln serve`` on the artifact (``--runs N`` times, each a fresh server), polls ``/health``
every 20 ms from the moment of ``Popen`` until it answers 200, and prints that time beside the
server's own start-up report (``/health``'s ``startup``: every process's phases, ``kiln.runtime.startup``),
then the best and median run. ``--out`` writes every run as JSON. Arguments after ``--`` go to
``kiln serve`` as they are (``-- --device cpu --kv-cache-tokens 8192``).

    python bench/startup.py --artifact smol.kiln --runs 3
    python bench/startup.py --artifact llama8b.kiln --runs 2 --out startup.json

For a first start on a fresh machine, empty the user's Triton cache first (``--fresh-triton-cache``
points ``TRITON_CACHE_DIR`` at a new empty directory for every run), so that only the artifact's
kernel binaries (``docs/artifact.md``) can spare the JIT.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

POLL_S = 0.02
START_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_start(artifact: str, serve_args: list[str], env: dict[str, str], log_path: Path) -> dict[str, Any]:
    """Starts a server, waits for /health, stops it; the wall time and the server's report."""
    port = free_port()
    with open(log_path, "wb") as log:
        began = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "kiln", "serve", artifact, "--port", str(port), *serve_args],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            health = _wait_healthy(proc, f"http://127.0.0.1:{port}/health", log_path)
            seconds = time.monotonic() - began
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return {"health_seconds": round(seconds, 3), "startup": health.get("startup")}


def _wait_healthy(proc: subprocess.Popen, url: str, log_path: Path) -> dict[str, Any]:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kiln serve exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            response = httpx.get(url, timeout=2)
            if response.status_code == 200:
                return response.json()
        except httpx.TransportError:
            pass
        time.sleep(POLL_S)
    raise TimeoutError(f"no /health in {START_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}")


def phase_table(report: dict[str, Any] | None) -> str:
    """The server's phases, one a line in start order: process, name, seconds, start offset."""
    if not report:
        return "  (the server reported no start-up phases)"
    lines = [f"  {'process':<12} {'phase':<15} {'seconds':>8} {'at':>7}"]
    lines += [f"  {p['process']:<12} {p['name']:<15} {p['seconds']:>8.3f} {p['start']:>7.3f}" for p in report["phases"]]
    return "\n".join(lines + [f"  {'http':<12} {'ready':<15} {report['seconds']:>8.3f}"])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", required=True, help="the compiled artifact directory to serve")
    parser.add_argument("--runs", type=int, default=3, help="fresh starts to time (default 3)")
    parser.add_argument("--fresh-triton-cache", action="store_true",
                        help="an empty TRITON_CACHE_DIR for every run (a first start on a fresh machine)")
    parser.add_argument("--out", type=Path, default=None, help="write every run as JSON here")
    args = parser.parse_args(own)
    runs = []
    with tempfile.TemporaryDirectory(prefix="kiln-startup-") as scratch:
        for run in range(args.runs):
            env = dict(os.environ)
            if args.fresh_triton_cache:
                env["TRITON_CACHE_DIR"] = str(Path(scratch) / f"triton-{run}")
            result = one_start(args.artifact, serve_args, env, Path(scratch) / f"serve-{run}.log")
            runs.append(result)
            print(f"run {run + 1}: /health after {result['health_seconds']:.2f} s")
            print(phase_table(result["startup"]))
    seconds = [r["health_seconds"] for r in runs]
    print(f"/health after: best {min(seconds):.2f} s, median {statistics.median(seconds):.2f} s over {len(runs)} runs")
    if args.out is not None:
        args.out.write_text(json.dumps({"artifact": args.artifact, "serve_args": serve_args, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
