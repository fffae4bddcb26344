"""The server's child processes, as the launcher sees them: started with a JSON argument, watched,
signalled and stopped (killed if they linger)."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time
from typing import Any, Callable, Mapping

log = logging.getLogger("kiln.server")

CHILD_POLL_S = 0.2


class Children:
    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, module: str, config: dict[str, Any], pass_fds: tuple[int, ...] = (),
              env: Mapping[str, str] | None = None) -> None:
        """Runs ``python -m module CONFIG_JSON``; ``pass_fds``: descriptors it inherits, ``env``: its
        environment (default: this one's)."""
        self.procs[name] = subprocess.Popen([sys.executable, "-m", module, json.dumps(config)], pass_fds=pass_fds,
                                            env=env)

    def exited(self) -> tuple[str, int] | None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                return name, proc.returncode
        return None

    async def watch(self, on_exit: Callable[[str, int], None]) -> None:
        while (gone := self.exited()) is None:
            await asyncio.sleep(CHILD_POLL_S)
        on_exit(*gone)

    def signal(self, sig: int) -> None:
        """Sends ``sig`` to each child still running."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(sig)

    def stop(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for name, proc in self.procs.items():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("the %s process did not exit; killing it", name)
                proc.kill()
                proc.wait()
