"""The server's first steps, before its web stack is imported: bind the port, start the children.

``kiln serve`` calls ``start_processes`` as soon as it knows the artifact, so the scheduler
process(es) import torch and load the model while the HTTP process imports FastAPI and uvicorn
(``launch.serve`` then takes the started processes over; it starts them itself when called
without). The port is bound first, so a busy port fails before any child starts; with several API
servers (``--api-server-count``) once per API server, with SO_REUSEPORT. Each child is
``python -m`` with a JSON argument (no pickled state crosses), which carries the wall-clock time of
its ``Popen`` (``spawned_at``) for its start-up report (``kiln.runtime.startup``).

Light on purpose: the standard library only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from kiln.artifact_format import MANIFEST

log = logging.getLogger("kiln.server")

CHILD_POLL_S = 0.2


class Children:
    """Child processes (the scheduler and detokenizer; the extra API servers, ``api_servers.py``),
    started with a JSON argument, watched, signalled and stopped (killed if they linger)."""

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, module: str, config: dict[str, Any], pass_fds: tuple[int, ...] = (),
              env: Mapping[str, str] | None = None) -> None:
        """Runs ``python -m module CONFIG_JSON``; ``pass_fds``: descriptors it inherits, ``env``: its
        environment (default: this one's)."""
        config = {**config, "spawned_at": time.time()}
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


@dataclass
class StartedProcesses:
    """What ``start_processes`` made: the bound (not yet listening) HTTP sockets (one per API server),
    the private ipc:// socket directory and the children; ``launch`` owns and closes them from then on."""

    listeners: list[socket.socket]
    ipc_dir: str
    children: Children

    def close_listeners(self) -> None:
        for listener in self.listeners:
            listener.close()

    def abandon(self) -> None:
        """Stops everything when the server gives up before serving (a bad option found late). The
        children ignore SIGTERM (the HTTP process drains first), so they are killed."""
        for proc in self.children.procs.values():
            proc.kill()
            proc.wait()
        self.close_listeners()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def scheduler_name(replica: int, replicas: int) -> str:
    return "scheduler" if replicas == 1 else f"replica {replica} scheduler"


def bind_port(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """The HTTP socket, bound but not yet listening (uvicorn listens once the model is ready)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def bind_ports(host: str, port: int, count: int) -> list[socket.socket]:
    """One HTTP socket per API server on the port. Several are bound with SO_REUSEPORT (the kernel
    spreads new connections over them), once a plain bind found the port free: a server holding it
    with SO_REUSEPORT would share it silently otherwise."""
    first = bind_port(host, port)
    if count == 1:
        return [first]
    first.close()
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sockets.append(bind_port(host, port, reuse_port=True))
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def start_processes(artifact: str, host: str, port: int, replicas: int, engine: dict[str, Any],
                    lora_modules: dict[str, str], log_level: str, disaggregation: str = "null",
                    bootstrap_port: int = 8998, api_servers: int = 1, stream_interval: int = 1) -> StartedProcesses | None:
    """Binds the port and starts the scheduler(s) and the detokenizer; None (the reason logged)
    when the port is busy. ``disaggregation``, ``bootstrap_port``, ``api_servers`` and ``stream_interval``:
    ``ServeConfig``'s ``disaggregation_mode``, ``bootstrap_port``, ``api_server_count`` and ``stream_interval``."""
    try:
        listeners = bind_ports(host, port, api_servers)
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s (is another server using the port? pick one with --port)",
                  host, port, exc.strerror or exc)
        return None
    ipc_dir = tempfile.mkdtemp(prefix="kiln-")
    children = Children()
    base = {"ipc_dir": ipc_dir, "parent_pid": os.getpid(), "log_level": log_level, "api_servers": api_servers}
    for replica in range(replicas):
        children.start(scheduler_name(replica, replicas), "kiln.server.scheduler_process",
                       {**base, "artifact": artifact, "engine": engine, "replica": replica,
                        "lora_modules": lora_modules, "disaggregation": disaggregation,
                        "bootstrap_port": bootstrap_port, "stream_interval": stream_interval})
    # The detokenizer loads the tokenizer at once, while the scheduler loads the model.
    children.start("detokenizer", "kiln.server.detokenizer_process",
                   {**base, "tokenizer_dir": artifact_tokenizer_dir(artifact)})
    return StartedProcesses(listeners, ipc_dir, children)


def artifact_tokenizer_dir(artifact: str) -> str | None:
    """The artifact's tokenizer directory, from its manifest (read here without the runtime, which
    imports torch); None for a token-id-only model."""
    name = json.loads((Path(artifact) / MANIFEST).read_text()).get("tokenizer")
    return str(Path(artifact) / name) if name else None
