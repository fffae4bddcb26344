"""One HTTP process's serving (the launcher's, and each extra API server's): the app and its tokenizer
manager on a listening socket, gRPC beside it on API server 0, the watches that stop it when a process
it needs is gone, and ``KilnServer``, uvicorn with kiln's signal handling (SIGTERM drains: new requests
get 503, those in flight may finish for up to ``drain_timeout`` seconds; SIGINT stops at once)."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Coroutine

import uvicorn
import zmq
import zmq.asyncio

from kiln.lora_layout import LoraLayout
from kiln.runtime.startup import Phase, StartupReport, StartupTimer, process_started_at
from kiln.runtime.text.tokenizer import Tokenizer

from . import ipc
from .context import ServerContext
from .gate import ServerState
from .http import build_app
from .in_flight import SamplesInFlight
from .lora_routes import ServerAdapters
from .metrics import ServerMetrics
from .peers import Peers
from .router import CacheAwareRouter
from .serve_config import ServeConfig
from .tokenizer_manager import ModelInfo, TokenizerManager
from .tools import resolve_parser

log = logging.getLogger("kiln.server")

# Once told to exit, uvicorn waits this long for open connections before closing them.
GRACEFUL_CLOSE_S = 5


class KilnServer(uvicorn.Server):
    """uvicorn with kiln's signal handling: drain on SIGTERM, stop at once on SIGINT."""

    def __init__(self, config: uvicorn.Config, state: ServerState, manager: TokenizerManager,
                 drain_timeout: float, forward_signal: Callable[[int], None] | None = None) -> None:
        """``forward_signal``: passes a SIGTERM or SIGINT on (to the other API servers)."""
        super().__init__(config)
        self.state = state
        self.manager = manager
        self.drain_timeout = drain_timeout
        self.forward_signal = forward_signal
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self.on_listening: Callable[[], None] | None = None  # called once the socket accepts connections

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.on_listening is not None and self.started:
            self.on_listening()

    def handle_exit(self, sig: int, frame: Any) -> None:
        # Replaces uvicorn's handler, which re-raises the signal once serving ends and so would kill
        # this process before it stops its children. Signal handlers run between bytecodes of the
        # loop's thread: hand the work to the loop.
        if self.forward_signal is not None:
            self.forward_signal(sig)
        if sig == signal.SIGTERM and not self.state.draining:
            self._loop.call_soon_threadsafe(self._begin_drain)
        else:
            self._loop.call_soon_threadsafe(self.stop, 0, "interrupted")

    def stop(self, exit_code: int, reason: str) -> None:
        """Fails what is in flight and makes uvicorn exit; a second call forces it."""
        if self.should_exit:
            self.force_exit = True
        self.exit_code = max(self.exit_code, exit_code)
        self.manager.fail_all(503 if exit_code == 0 else 500, f"the server is shutting down: {reason}")
        self.should_exit = True

    def _begin_drain(self) -> None:
        log.info("SIGTERM: refusing new requests, draining %d in flight (up to %g s)",
                 self.state.active, self.drain_timeout)
        self.state.draining = True
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        while self.state.active > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.state.active:
            log.warning("drain timeout: failing %d requests still in flight", self.state.active)
        self.stop(0, "the drain timeout passed")


def run_event_loop(main: Coroutine[Any, Any, int]) -> int:
    """Runs an HTTP process's ``main`` to its exit code on uvloop, which spends less of the process's
    CPU (the server's limit at a GPU's token rates) per streamed token than asyncio's loop; on
    asyncio's own where uvloop is not installed (it is not built for Windows)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


@dataclass(frozen=True)
class ProcessTies:
    """How one HTTP process (API server) is tied to the server's other processes."""

    # Each returns once a process this one needs is gone, calling back with what happened.
    watches: list[Callable[[Callable[[str], None]], Awaitable[None]]]
    # Before it listens: starts what serves beside it (given "should it stop?"); False: it stops.
    start: Callable[[Callable[[], bool]], Awaitable[bool]] | None = None
    listening: Callable[[], None] | None = None  # once it listens
    forward_signal: Callable[[int], None] | None = None  # a SIGTERM or SIGINT it got, passed on


async def run_http(config: ServeConfig, replica_facts: list[dict[str, Any]], tokenizer: Tokenizer | None,
                   listener: socket.socket, receiver: zmq.asyncio.Socket, senders: list[zmq.Socket],
                   ties: ProcessTies, peers: Peers, samples_in_flight: SamplesInFlight | None = None,
                   startup: StartupTimer | None = None) -> int:
    """Serves HTTP on ``listener`` until stopped, as API server ``peers.me`` (0 also serves gRPC);
    returns the exit code. Every API server process runs this, the launcher and those it started;
    ``startup``: the launcher's start-up phases (the server's start-up report is made once it listens,
    and sent to the other API servers)."""
    facts = replica_facts[0]  # the replicas serve one artifact
    models_ready_at = time.time()
    info = ModelInfo(config.served_model_name, facts["vocab_size"], facts["max_seq_len"], int(time.time()),
                     sum(f["max_running"] for f in replica_facts))
    metrics = ServerMetrics(config.dp, peers.me)
    metrics.replica_stats.update((f["replica"], f["stats"]) for f in replica_facts)
    state = ServerState()
    server: KilnServer | None = None

    def fatal(message: str) -> None:
        log.error("%s", message)
        server.stop(1, message)

    def process_gone(message: str) -> None:
        manager.failure = message
        fatal(message)

    manager = TokenizerManager(tokenizer, info, senders, metrics, on_fatal=fatal,
                               router=CacheAwareRouter(config.dp, metrics, config.router), admission=config.admission,
                               api_server=peers.me, samples_in_flight=samples_in_flight)
    layout = LoraLayout.from_json(facts["lora"]) if facts.get("lora") else None
    ctx = ServerContext(manager, state, metrics, config.max_n, resolve_parser(config.tool_call_parser, tokenizer),
                        ServerAdapters(layout, dict(config.lora_modules)), peers)
    app = build_app(ctx, config.api_key, config.max_body_bytes)
    # httptools, not h11: less CPU per streamed token in the process that is the server's limit (pyproject).
    server = KilnServer(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                       http="httptools", access_log=False, lifespan="off",
                                       timeout_graceful_shutdown=GRACEFUL_CLOSE_S),
                        state, manager, config.drain_timeout, ties.forward_signal)

    def listening() -> None:
        if startup is not None:
            startup.since("http_ready", models_ready_at)
            phases = [Phase.from_wire(item) for f in replica_facts for item in f.get("startup", [])]
            metrics.startup = StartupReport(process_started_at(), time.time(), (*startup.phases, *phases))
            log.info("start-up: %s", metrics.startup.summary())
            for other in range(1, peers.count):  # the server's report, served by every API server
                peers.tell(other, [ipc.READY, {"startup": metrics.startup.to_wire()}])
        if ties.listening is not None:
            ties.listening()

    def from_peers(message: list[Any]) -> bool:
        if message[0] == ipc.READY and "startup" in message[1]:  # API server 0's start-up report
            metrics.startup = StartupReport.from_wire(message[1]["startup"])
            return True
        return peers.handle(message)

    server.on_listening = listening
    tasks = [asyncio.ensure_future(manager.receive_loop(receiver, from_peers)),
             *(asyncio.ensure_future(watch(process_gone)) for watch in ties.watches)]
    tasks[0].add_done_callback(lambda t: t.cancelled() or fatal(f"the output receiver failed: {t.exception()!r}"))
    grpc_server = None
    try:
        if ties.start is not None and not await ties.start(lambda: server.should_exit):
            return max(server.exit_code, 1)
        if config.grpc_port is not None and peers.me == 0:
            from .grpc.servicer import start_grpc_server

            try:
                grpc_server = await start_grpc_server(ctx, config.host, config.grpc_port, config.api_key,
                                                      config.max_body_bytes)
            except OSError as error:
                log.error("%s", error)
                return 1
            log.info("gRPC on %s:%d", config.host, config.grpc_port)
        if peers.me == 0:
            log.info("model ready; serving it as %r", config.served_model_name)
        # uvicorn's signal handlers take over from start-up's (which would still see the signals).
        asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)
        await server.serve(sockets=[listener])
    finally:
        if grpc_server is not None:
            await grpc_server.stop(GRACEFUL_CLOSE_S)
        for task in tasks:
            task.cancel()
    return server.exit_code
