"""Where a serving run's host time goes: the CPU seconds of each process of a running ``kiln serve``
(the launcher's API server, the other API servers, the scheduler, the detokenizer) and of the load
generator, over one ``bench/serving.py`` run, per output token and as a share of one core.

A process that needs about one core for the run is the server's limit; the scheduler's share also
holds its wait for the GPU. Read from ``/proc/<pid>/stat`` (Linux) before and after the load; the load
generator's processes are counted through its exit (``RUSAGE_CHILDREN``).

    kiln serve ART --port 30000 --api-server-count 4 & ...
    python bench/experiments/server_cpu.py --server-pid PID -- --base-url http://127.0.0.1:30000 --model m \\
        --num-prompts 512 --input-len 256 --output-len 128 --ignore-eos --max-concurrency 256 --workers 4
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process (None once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS


# The server's processes by the module each runs (``python -m MODULE CONFIG``; the launcher is ``kiln``).
ROLES = {"kiln.server.scheduler_process": "scheduler", "kiln.server.detokenizer_process": "detokenizer",
         "kiln.server.api_server_process": "API server", "kiln": "launcher (API server 0)"}


def role_of(argv: list[str]) -> str:
    """A process's part in the server, from its command line (the launcher may also be the ``kiln``
    console script)."""
    if len(argv) > 2 and argv[1] == "-m":
        module = argv[2]
    else:
        module = "kiln" if len(argv) > 1 and Path(argv[1]).name == "kiln" else ""
    return ROLES.get(module, " ".join(argv)[:60])


def role(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "gone"
    return role_of([a.decode(errors="replace") for a in raw.split(b"\0") if a])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server-pid", type=int, required=True, help="the kiln serve process")
    parser.add_argument("serving_args", nargs=argparse.REMAINDER, help="-- then bench/serving.py's arguments")
    args = parser.parse_args()
    load_args = args.serving_args[1:] if args.serving_args[:1] == ["--"] else args.serving_args
    pids = descendants(args.server_pid)
    before = {pid: cpu_seconds(pid) for pid in pids}
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "served.json"
        started = time.monotonic()
        subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "serving.py"), *load_args,
                        "--out", str(out)], check=True)
        seconds = time.monotonic() - started
        served = json.loads(out.read_text())
    children_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    tokens = served["output_tokens"]
    rows = []
    for pid in pids:
        after = cpu_seconds(pid)
        if after is not None and before[pid] is not None:
            rows.append((role(pid), pid, after - before[pid]))
    load = (children_after.ru_utime + children_after.ru_stime) - (children_before.ru_utime + children_before.ru_stime)
    rows.append(("load generator (all its processes)", 0, load))
    print(f"{tokens} output tokens in {seconds:.2f} s ({tokens / seconds:,.0f} tok/s, "
          f"{served['completed']} requests, {served['failed']} failed)")
    print("| process | pid | CPU s | us per output token | share of one core |")
    print("|---|---:|---:|---:|---:|")
    for name, pid, cpu in sorted(rows, key=lambda row: -row[2]):
        print(f"| {name} | {pid or '-'} | {cpu:.2f} | {cpu / tokens * 1e6:.1f} | {cpu / seconds:.0%} |")


if __name__ == "__main__":
    main()
