"""http_process.run_event_loop: an HTTP process's main runs on uvloop (less CPU per streamed token
than asyncio's own loop), and its result is the process's exit code."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from kiln.server.http_process import run_event_loop


def test_an_http_process_runs_on_uvloop():
    async def main() -> int:
        assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")
        return 3

    assert run_event_loop(main()) == 3


def test_the_web_stack_import_takes_fastapis_lazy_pydantic_v1_import():
    """FastAPI imports pydantic.v1 as it builds its first route: importing the app's module (which the
    server does while the model loads) takes it, so building the app after the model is ready does not."""
    code = "import sys, kiln.server.http; print('pydantic.v1' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "True", done.stderr
