"""bench/experiments/server_cpu.py: a process tree found below its root, each process's CPU seconds read
from /proc (real processes), and each server process's part named from its command line."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"
sys.path[:0] = [str(BENCH / "experiments"), str(BENCH)]
from server_cpu import cpu_seconds, descendants, role, role_of  # noqa: E402

# A parent that spins for 0.3 s of CPU, starts a sleeping child, says its pid and waits.
PARENT = """
import subprocess, sys, time
end = time.process_time() + 0.3
while time.process_time() < end:
    pass
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux's /proc")
def test_descendants_and_their_cpu():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        assert set(descendants(parent.pid)) == {parent.pid, child}
        assert cpu_seconds(parent.pid) >= 0.25 and cpu_seconds(child) < 0.25
        # An unknown command is named by its (clipped) command line, however long the python's path.
        assert role(child) == role_of([sys.executable, "-c", "import time; time.sleep(60)"])
    finally:
        for pid in (child, parent.pid):
            subprocess.run(["kill", str(pid)], check=False)
        parent.wait()
    time.sleep(0.2)
    assert cpu_seconds(parent.pid) is None and role(parent.pid) == "gone"


def test_roles_from_command_lines():
    python = sys.executable
    assert role_of([python, "-m", "kiln", "serve", "a.kiln"]) == "launcher (API server 0)"
    assert role_of([python, "/x/.venv/bin/kiln", "serve", "a.kiln"]) == "launcher (API server 0)"
    assert role_of([python, "-m", "kiln.server.scheduler_process", "{}"]) == "scheduler"
    assert role_of([python, "-m", "kiln.server.detokenizer_process", "{}"]) == "detokenizer"
    assert role_of([python, "-m", "kiln.server.api_server_process", "{}"]) == "API server"
    assert role_of([python, "bench/serving.py"]) == f"{python} bench/serving.py"[:60]
