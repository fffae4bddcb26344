"""More HTTP processes on one port: ``kiln serve --api-server-count N`` (vLLM's name for it).

    API server 0 = the launcher (launch.py): FastAPI + tokenizer manager (+ gRPC) ---+-- ADD, ABORT --> scheduler(s)
    API servers 1..N-1 (api_server_process.py): FastAPI + own tokenizer manager ----+
    detokenizer --OUTPUTS--> http<j>.sock of the API server j that sent the request (ADD names it)

When one HTTP process -- parsing, tokenizing, templating, SSE frames on one Python thread -- is the
bottleneck, N of them share the engine. Each has its own listening socket on the port, bound with
SO_REUSEPORT by the launcher before the model loads and inherited, so the kernel spreads new
connections over them. The launcher starts the others as the model starts loading (their imports
and tokenizers load beside it), tells them the replicas' facts once every replica is READY
(``MODELS``), starts listening once every one of them listens (``READY``), and watches them like its
other children: one that exits ends the server. A SIGTERM or SIGINT the launcher gets is passed on (each API server drains
or stops its own requests); the launcher waits for them to end before it stops the scheduler and
detokenizer that their requests need. An API server whose launcher is gone stops.

What is the server's, not one process's: the queue limit (``SamplesInFlight``, shared), the metrics
and the LoRA adapters served (``peers.py``). The gRPC API is served by API server 0 alone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from pathlib import Path
from typing import Any, Callable

import zmq

from . import ipc
from .children import CHILD_POLL_S, Children
from .in_flight import SamplesInFlight
from .peers import Peers

log = logging.getLogger("kiln.server")

MODULE = "kiln.server.api_server_process"
API_KEY_ENV = "KILN_API_SERVER_KEY"  # the API key reaches the others by environment, never by command line
IN_FLIGHT_FILE = "in_flight"


def peer_sockets(context: zmq.Context, ipc_dir: str, me: int, count: int) -> dict[int, zmq.Socket]:
    """A PUSH socket to every other API server's inbox, by index."""
    return {j: ipc.push_socket(context, ipc.address(ipc_dir, ipc.http_socket(j))) for j in range(count) if j != me}


def samples_in_flight(ipc_dir: str, me: int, count: int) -> SamplesInFlight | None:
    """API server ``me``'s view of the server's count (None: one API server, which counts alone)."""
    return SamplesInFlight(str(Path(ipc_dir) / IN_FLIGHT_FILE), me, count) if count > 1 else None


class ApiServers:
    """API servers 1..N-1, as the launcher (API server 0) starts, watches, signals and stops them."""

    def __init__(self, context: zmq.Context, ipc_dir: str, count: int) -> None:
        self.count = count
        self.ipc_dir = ipc_dir
        self.children = Children()
        self.peers = Peers(0, peer_sockets(context, ipc_dir, 0, count))
        self._stop_signal: int | None = None  # the signal passed on, once the server stops
        if count > 1:
            SamplesInFlight.create(str(Path(ipc_dir) / IN_FLIGHT_FILE), count)

    def samples_in_flight(self) -> SamplesInFlight | None:
        return samples_in_flight(self.ipc_dir, 0, self.count)

    def start(self, listeners: list[socket.socket], config: dict[str, Any], api_key: str | None) -> None:
        """Starts API server j on ``listeners[j - 1]``; ``config``: what every one of them gets."""
        if not listeners:
            return
        log.info("starting %d more API server processes", len(listeners))
        env = None if api_key is None else {**os.environ, API_KEY_ENV: api_key}
        for index, listener in enumerate(listeners, start=1):
            fd = listener.fileno()
            self.children.start(f"API server {index}", MODULE, {**config, "api_server": index, "listen_fd": fd},
                                pass_fds=(fd,), env=env)
            listener.close()  # the child has it

    def tell_models(self, facts: list[dict[str, Any]]) -> None:
        """What the API servers started before the model was ready wait for: every replica's facts."""
        for index in range(1, self.count):
            self.peers.tell(index, [ipc.MODELS, facts])

    async def wait_ready(self, should_stop: Callable[[], bool]) -> bool:
        """Waits until every one listens; False if the server stops first."""
        while len(self.peers.ready) < self.count - 1:
            if should_stop():
                return False
            await asyncio.sleep(CHILD_POLL_S / 4)
        return True

    async def watch(self, on_exit: Callable[[str], None]) -> None:
        def exited(name: str, code: int) -> None:
            if self._stop_signal is None:  # else it was told to stop
                on_exit(f"the {name} process exited unexpectedly (code {code})")

        await self.children.watch(exited)

    def signal(self, sig: int) -> None:
        """Passes a SIGTERM (drain) or SIGINT (stop at once) on."""
        if self._stop_signal != signal.SIGINT:
            self._stop_signal = sig
        self.children.signal(sig)

    def stop(self, drain_s: float, stop_s: float) -> None:
        """Ends them: those draining get ``drain_s``; otherwise they are told to stop at once and get ``stop_s``."""
        if self._stop_signal is None:  # the server stops for its own reasons (a child died, start-up ended)
            self.signal(signal.SIGINT)
        self.children.stop(drain_s if self._stop_signal == signal.SIGTERM else stop_s)

    def close(self) -> None:
        self.peers.close()
