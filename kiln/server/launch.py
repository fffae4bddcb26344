"""``kiln serve``: starts the processes, waits for the model, serves HTTP, and stops cleanly.

    HTTP process (this one)        scheduler process(es)          detokenizer process
    FastAPI + TokenizerManager --> EngineCore loop ------------> SampleText per sample --+
      (+ router with --dp N)       (one per replica)                                   |
           ^                                                                           |
           +---------------------------- outputs, stats, ready ------------------------+

With ``dp`` > 1 there are that many scheduler processes (data-parallel replicas, each its own
engine core and KV cache), one inbox each, and the tokenizer manager's cache-aware router
(``router.py``) picks one for each prompt; they share the detokenizer. A replica that exits ends
the server like any child. With ``api_server_count`` > 1 this process is API server 0 of that many
HTTP processes on the port, each with its own tokenizer manager (``api_servers.py``).

Start-up: compile the model if needed (``ensure_artifact``), bind the port (a busy port fails at
once, before the model loads), start both children (``children.start_processes``: ``kiln serve``
does that before it imports this module, so the model loads while the web stack imports), load
the tokenizer while waiting for READY (the model is loaded and the detokenizer has its tokenizer),
and only then listen on the port. The start-up phases of every process (``kiln.runtime.startup``)
are logged, then summed up in one line, and served in ``/health`` and ``/metrics``. While serving, a watcher notices a
child that exits: the server logs it, fails requests in flight with 500 and exits non-zero.
SIGTERM drains: new requests get 503, those in flight may finish for up to ``drain_timeout``
seconds (then they fail with 503), and the server exits 0. SIGINT (or a second SIGTERM) stops at
once. Children are told to shut down, then killed if they linger; they also exit on their own
when this process dies. The ipc:// socket directory is removed on the way out.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Awaitable, Callable

import uvicorn
import zmq
import zmq.asyncio

from kiln.lora_layout import LoraLayout
from kiln.runtime.startup import Phase, StartupReport, StartupTimer, process_started_at
from kiln.runtime.worker.nccl_env import keep_multicast_off
from kiln.runtime.text.tokenizer import Tokenizer

from . import ipc
from .api_servers import ApiServers
from .children import (CHILD_POLL_S, Children, StartedProcesses, artifact_tokenizer_dir, scheduler_name,
                       start_processes)
from .context import ServerContext
from .gate import ServerState
from .http import build_app
from .in_flight import SamplesInFlight
from .metrics import ServerMetrics
from .peers import Peers
from .router import CacheAwareRouter, RouterOptions
from .lora_routes import ServerAdapters
from .tokenizer_manager import Admission, ModelInfo, TokenizerManager
from .tools import resolve_parser

log = logging.getLogger("kiln.server")

CHILD_STOP_TIMEOUT_S = 10.0
# After a child died the server is failing anyway: the survivor gets this long, then SIGKILL, so
# the server exits within seconds (a scheduler's orderly exit can take longer on a busy machine).
CHILD_STOP_AFTER_FAILURE_S = 1.0
# Once told to exit, uvicorn waits this long for open connections before closing them.
GRACEFUL_CLOSE_S = 5


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str = "model"
    max_body_bytes: int = 8 * 1024 * 1024
    max_n: int = 16
    drain_timeout: float = 30.0
    log_level: str = "info"
    tool_call_parser: str | None = None  # None: the one the chat template implies
    grpc_port: int | None = None  # also serve kiln.proto's gRPC API on this port
    engine: dict[str, Any] = field(default_factory=dict)  # EngineOptions fields
    dp: int = 1                                            # data-parallel replicas
    router: RouterOptions = RouterOptions()
    admission: Admission = Admission()                     # the queue limit (--max-queued-requests)
    lora_modules: dict[str, str] = field(default_factory=dict)  # LoRA adapters served from the start, by name
    # Prefill/decode disaggregation (server/disaggregation.py): "null" (off), "prefill" or "decode".
    disaggregation_mode: str = "null"
    bootstrap_port: int = 8998   # the prefill side's KV handoff port
    api_server_count: int = 1    # HTTP processes sharing the port (--api-server-count)

    def scheduler_name(self, replica: int) -> str:
        return scheduler_name(replica, self.dp)

    def start_processes(self, artifact: str) -> StartedProcesses | None:
        """Binds the port and starts the children (None when the port is busy; the reason logged)."""
        return start_processes(artifact, self.host, self.port, self.dp, self.engine, self.lora_modules,
                               self.log_level, self.disaggregation_mode, self.bootstrap_port, self.api_server_count)

    def to_json(self) -> dict[str, Any]:
        """Everything but the API key (which must not show in a command line), as JSON data."""
        return {**asdict(self), "api_key": None}

    @staticmethod
    def from_json(data: dict[str, Any], api_key: str | None) -> "ServeConfig":
        return ServeConfig(**{**data, "api_key": api_key, "router": RouterOptions(**data["router"]),
                              "admission": Admission(**data["admission"])})


class StartupError(RuntimeError):
    """A child reported FATAL or exited before the model was ready."""


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


def check_disaggregation(artifact: str, config: ServeConfig) -> None:
    """What a prefill or decode server cannot run, refused before anything starts (runtime/disagg/support.py)."""
    # Here, not at the top: the engine's options import torch, which the HTTP process otherwise never loads.
    from kiln.runtime.disagg.support import check_artifact_supported
    from kiln.runtime.engine_options import EngineOptions

    if config.dp > 1:
        raise ValueError("--disaggregation-mode: a prefill or decode server runs one replica; leave --dp at 1")
    if config.lora_modules:
        raise ValueError("--disaggregation-mode: LoRA adapters are not served with disaggregation (the handed-over "
                         "KV pages are the base model's); serve --lora-modules without it")
    check_artifact_supported(artifact, EngineOptions(**config.engine))


def serve(artifact: str, config: ServeConfig, startup: StartupTimer | None = None,
          started: StartedProcesses | None = None) -> int:
    """Runs the server until it is stopped; returns the process exit code. ``started``: the port and
    children ``kiln serve`` set up before it imported this module (else they are started here);
    ``startup``: this process's start-up phases so far."""
    try:
        if config.dp < 1:
            raise ValueError(f"dp must be at least 1, got {config.dp}")
        if config.api_server_count < 1:
            raise ValueError(f"api_server_count must be at least 1, got {config.api_server_count}")
        if config.disaggregation_mode != "null":
            check_disaggregation(artifact, config)
        config.router.validate()
        config.admission.validate()
    except ValueError:
        if started is not None:
            started.abandon()
        raise
    keep_multicast_off()  # the children inherit it (serve may be called without the command line)
    logging.basicConfig(level=config.log_level.upper(), format="kiln: %(message)s")
    started = started or config.start_processes(artifact)
    if started is None:
        return 1
    try:
        return asyncio.run(_serve(started, artifact, config, startup or StartupTimer("http")))
    finally:
        started.close_listeners()


async def _serve(started: StartedProcesses, artifact: str, config: ServeConfig, startup: StartupTimer) -> int:
    ipc_dir, children = started.ipc_dir, started.children
    context = zmq.Context()
    receiver = zmq.asyncio.Context.shadow(context.underlying).socket(zmq.PULL)
    receiver.setsockopt(zmq.LINGER, 0)
    receiver.bind(ipc.address(ipc_dir, ipc.http_socket(0)))
    senders = [ipc.push_socket(context, ipc.address(ipc_dir, ipc.scheduler_socket(i))) for i in range(config.dp)]
    # Each child is told to stop directly: a dead scheduler could not pass the word on.
    stoppers = [*senders, ipc.push_socket(context, ipc.address(ipc_dir, ipc.DETOKENIZER_SOCKET))]
    api_servers = ApiServers(context, ipc_dir, config.api_server_count)
    loop = asyncio.get_running_loop()
    # Until uvicorn installs its handlers, SIGTERM cancels start-up (and the cleanup below runs).
    loop.add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    # The tokenizer loads while the model does.
    tokenizer = asyncio.ensure_future(asyncio.to_thread(_load_tokenizer, artifact, startup))
    try:
        try:
            facts = await _wait_ready(receiver, children, config.dp)
        except StartupError as exc:
            log.error("%s", exc)
            return 1

        async def start_api_servers(should_stop: Callable[[], bool]) -> bool:
            child_config = {"ipc_dir": ipc_dir, "parent_pid": os.getpid(), "log_level": config.log_level,
                            "api_servers": config.api_server_count, "serve": config.to_json(), "facts": facts}
            api_servers.start(started.listeners[1:], child_config, config.api_key)
            return await api_servers.wait_ready(should_stop)

        watches = [lambda on_exit: children.watch(lambda name, code: on_exit(
                       f"the {name} process exited unexpectedly (code {code})")), api_servers.watch]
        return await run_http(config, facts, await tokenizer, started.listeners[0], receiver, senders,
                              ProcessTies(watches, start_api_servers, forward_signal=api_servers.signal),
                              api_servers.peers, api_servers.samples_in_flight(), startup)
    except asyncio.CancelledError:
        log.info("stopped during start-up")
        return 128 + signal.SIGTERM
    finally:
        tokenizer.cancel()
        loop.remove_signal_handler(signal.SIGTERM)
        # The API servers first: their requests in flight need the scheduler and detokenizer.
        api_servers.stop(config.drain_timeout + GRACEFUL_CLOSE_S + CHILD_STOP_TIMEOUT_S, CHILD_STOP_TIMEOUT_S)
        for stopper in stoppers:
            stopper.send(ipc.pack([ipc.SHUTDOWN]))
        children.stop(CHILD_STOP_TIMEOUT_S if children.exited() is None else CHILD_STOP_AFTER_FAILURE_S)
        receiver.close()
        api_servers.close()
        for stopper in stoppers:
            stopper.close(linger=0)  # the children are gone: a SHUTDOWN still queued (a dead child's) has no reader
        context.term()
        shutil.rmtree(ipc_dir, ignore_errors=True)


def _load_tokenizer(artifact: str, startup: StartupTimer) -> Tokenizer | None:
    directory = artifact_tokenizer_dir(artifact)
    with startup.phase("tokenizer"):
        return Tokenizer.from_dir(directory) if directory else None


async def _wait_ready(receiver: zmq.asyncio.Socket, children: Children, replicas: int) -> list[dict[str, Any]]:
    """Every replica's model facts, in replica order, once all of them are READY."""
    log.info("loading the model" + (f" into {replicas} replicas" if replicas > 1 else ""))
    facts: dict[int, dict[str, Any]] = {}
    while len(facts) < replicas:
        if await receiver.poll(int(CHILD_POLL_S * 1000)):
            message = ipc.unpack(await receiver.recv())
            if message[0] == ipc.READY:
                facts[message[1]["replica"]] = message[1]
            elif message[0] == ipc.FATAL:
                raise StartupError(message[1])
        elif (gone := children.exited()) is not None:
            raise StartupError(f"the {gone[0]} process exited with code {gone[1]} during start-up")
    return [facts[replica] for replica in range(replicas)]


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
    server = KilnServer(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                       access_log=False, lifespan="off", timeout_graceful_shutdown=GRACEFUL_CLOSE_S),
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
