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
and only then listen on the port (``http_process.run_http``, which every API server runs). The start-up phases of every process (``kiln.runtime.startup``)
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
from typing import Any, Callable

import zmq
import zmq.asyncio

from kiln.runtime.startup import StartupTimer
from kiln.runtime.worker.nccl_env import keep_multicast_off
from kiln.runtime.text.tokenizer import Tokenizer

from . import ipc
from .api_servers import ApiServers
from .children import CHILD_POLL_S, Children, StartedProcesses, artifact_tokenizer_dir
from .http_process import GRACEFUL_CLOSE_S, ProcessTies, run_event_loop, run_http
from .serve_config import ServeConfig

log = logging.getLogger("kiln.server")

CHILD_STOP_TIMEOUT_S = 10.0
# After a child died the server is failing anyway: the survivor gets this long, then SIGKILL, so
# the server exits within seconds (a scheduler's orderly exit can take longer on a busy machine).
CHILD_STOP_AFTER_FAILURE_S = 1.0


class StartupError(RuntimeError):
    """A child reported FATAL or exited before the model was ready."""


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
        return run_event_loop(_serve(started, artifact, config, startup or StartupTimer("http")))
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
        # The other API servers import and load their tokenizers while the model loads.
        tokenizer_dir = artifact_tokenizer_dir(artifact)
        api_servers.start(started.listeners[1:], {
            "ipc_dir": ipc_dir, "parent_pid": os.getpid(), "log_level": config.log_level,
            "api_servers": config.api_server_count, "serve": config.to_json(),
            "tokenizer_dir": str(tokenizer_dir) if tokenizer_dir else None}, config.api_key)
        try:
            facts = await _wait_ready(receiver, children, config.dp)
        except StartupError as exc:
            log.error("%s", exc)
            return 1

        async def start_api_servers(should_stop: Callable[[], bool]) -> bool:
            api_servers.tell_models(facts)
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
        return Tokenizer.from_dir(directory).prepare_for_requests() if directory else None


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
