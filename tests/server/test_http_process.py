"""http_process.run_event_loop: an HTTP process's main runs on uvloop (less CPU per streamed token
than asyncio's own loop), and its result is the process's exit code."""

from __future__ import annotations

import asyncio

from kiln.server.http_process import run_event_loop


def test_an_http_process_runs_on_uvloop():
    async def main() -> int:
        assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")
        return 3

    assert run_event_loop(main()) == 3
