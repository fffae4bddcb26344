"""Starting an engine's ranks: one in this process (``LocalWorker``), or a ``WorkerGroup``.

A group keeps rank 0 in the core's process and starts ranks 1..N-1 as worker processes
(``rank_process``; multiprocessing's spawn context, so no state is forked). Each loads its own model
runner while rank 0 loads its own, reports READY, and all join one torch.distributed group over
loopback (gloo on the CPU; NCCL for device tensors on a GPU); for a tensor-parallel artifact they
join first, since loading captures graphs that run the collectives (``load_and_join``). Each step
rank 0 broadcasts the step's lists (``step_wire``), then runs the step itself.

Failure ends the engine, quickly and completely: a watcher thread waits on the workers' process
sentinels; when one ends it records a ``WorkerDied`` naming the rank, its exit code and its last
error, and stops the other workers (they may be blocked on the dead one). The next step, or
``check()``, raises it; a broadcast that fails because a peer's connection closed raises it too.
``close()`` sends the stop message, joins the workers and kills any that linger.

On several nodes (``RankConfig.nnodes``, see ``nodes.py``) the group starts only node 0's ranks;
the others join the store at ``dist_init_addr`` from their own machines, and the watcher also
checks their heartbeats.
"""

from __future__ import annotations

import os
import signal
import threading
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist

from ..artifact import Artifact
from ..scheduler.batch import StepLists
from ..startup import StartupTimer
from .rank_grid import leave_groups
from .rank_process import HOST, READY, RENDEZVOUS_TIMEOUT, load_and_join, run_rank
from .executor import StepResult
from .nccl_env import keep_multicast_off
from .nodes import HEARTBEAT_S, NodeWatch, parse_addr, publish_config
from .step_wire import send_step
from .worker import LocalWorker, RankConfig, Worker, WorkerDied

# How long workers get to exit after the stop message (close) or SIGTERM (failure) before SIGKILL.
STOP_TIMEOUT_S = 5.0
KILL_TIMEOUT_S = 1.0
# How long a failed broadcast waits for the watcher to name the rank that ended.
FAILURE_WAIT_S = 2.0


def start_worker(artifact: Artifact, config: RankConfig, startup: StartupTimer | None = None) -> Worker:
    """``startup`` times rank 0's loading phases."""
    if config.world_size < 1:
        raise ValueError(f"world_size: must be at least 1, not {config.world_size}")
    if config.world_size == 1:
        return LocalWorker(config.build_runner(artifact, 0, startup))
    return WorkerGroup(artifact, config, startup)


class WorkerGroup:
    """Rank 0 in this process, ranks 1..N-1 in worker processes."""

    # Off with several ranks: a worker's step arrives whole from the host, and the in-flight step's
    # tokens reach the host only once that step ends, so sending them would wait for the step that
    # overlap exists not to wait for. (Tensor-parallel artifacts may broadcast them on the device.)
    tokens_from_device = False

    def __init__(self, artifact: Artifact, config: RankConfig, startup: StartupTimer | None = None) -> None:
        if dist.is_initialized():
            raise RuntimeError("world_size > 1: this process already has a torch.distributed group "
                               "(one multi-rank engine per process)")
        device = config.rank_device(0)
        last = config.rank_device(config.world_size - 1)
        if device.type == "cuda":
            if last.index >= torch.cuda.device_count():
                raise ValueError(f"world_size: {config.world_size} ranks from {device} need {last}, and this "
                                 f"host has {torch.cuda.device_count()} GPUs")
        keep_multicast_off()  # before any communicator, so rank 0 and the workers (which inherit it) agree
        self.failure: WorkerDied | None = None
        self.processes: list[BaseProcess] = []   # rank r is processes[r - 1]
        self._reports: list[Connection] = []
        self._lock = threading.Lock()            # the watcher and close() both reap the workers
        self._closed = False
        context = get_context("spawn")
        host, port = parse_addr(config.dist_init_addr) if config.nnodes > 1 else (HOST, 0)
        store = dist.TCPStore(host, port, config.world_size, True, timeout=RENDEZVOUS_TIMEOUT, wait_for_workers=False)
        try:
            if config.nnodes > 1:
                publish_config(store, config)
            for rank in config.node_ranks(0)[1:]:
                process, reader = spawn_rank(context, rank, host, store.port, config)
                self.processes.append(process)
                self._reports.append(reader)
            # While the workers load theirs.
            self.runner = load_and_join(0, store, config, lambda: config.build_runner(artifact, 0, startup),
                                         self._await_ready)
            self._nodes = NodeWatch(config) if config.nnodes > 1 else None
        except BaseException:
            self._stop_workers(terminate=True)
            raise
        self._store = store  # the group's rendezvous; kept for the group's lifetime
        self.device = self.runner.device
        self.num_pages = self.runner.pool.num_pages
        self.sample = self.runner.sample
        self.host_mirror = self.runner.host_mirror
        self._wake_r, self._wake_w = os.pipe()
        self._watcher = threading.Thread(target=self._watch, name="kiln-rank-watch", daemon=True)
        self._watcher.start()

    def forward(self, lists: StepLists, tokens_from: torch.Tensor | None = None) -> StepResult:
        if tokens_from is not None:
            raise ValueError("tokens_from: with several ranks a step's input ids come from the host")
        self._send(lists)
        try:
            return self.runner.forward(lists)
        except RuntimeError as exc:
            # A transfer whose peer ended (a stage's send or receive, a collective): that rank's
            # exit is the news, and the watcher is about to see it.
            self._watcher.join(FAILURE_WAIT_S)
            if self.failure is not None:
                raise self.failure from exc
            raise

    def check(self) -> None:
        if self.failure is not None:
            raise self.failure

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        os.write(self._wake_w, b"x")  # the workers' exits from here on are expected
        self._watcher.join()
        os.close(self._wake_r)
        os.close(self._wake_w)
        if self.failure is None:
            try:
                send_step(None)
            except RuntimeError:
                pass  # a worker already gone: it is reaped below either way
        self._stop_workers(terminate=False)
        leave_groups()
        dist.destroy_process_group()

    # ---- internals ----------------------------------------------------------------------------------

    def _send(self, lists: StepLists) -> None:
        self.check()
        try:
            send_step(lists)
        except RuntimeError as exc:
            # A peer's connection closed: its exit is the news, and the watcher is about to see it.
            self._watcher.join(FAILURE_WAIT_S)
            if self.failure is None:
                self.failure = WorkerDied(f"sending a step to the workers failed: {exc}")
                self._stop_workers(terminate=True)
            raise self.failure from exc

    def _await_ready(self) -> None:
        """Waits until every worker has loaded its model; raises ``WorkerDied`` for one that fails first."""
        pending = {reader: rank for rank, reader in enumerate(self._reports, start=1)}
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes, start=1)}
        while pending:
            for ready in wait([*pending, *sentinels]):
                if ready in sentinels:
                    raise self._death(sentinels[ready])
                if ready in pending:
                    message = _read(ready)
                    if message != READY:
                        raise self._death(pending[ready], message.decode(errors="replace"))
                    del pending[ready]

    def _watch(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes, start=1)}
        while True:
            # Other nodes' ranks have no sentinel here: their heartbeats are checked between waits.
            ready = wait([*sentinels, self._wake_r], HEARTBEAT_S if self._nodes is not None else None)
            if self._wake_r in ready:
                return
            if ready:
                self.failure = self._death(sentinels[ready[0]])
                break
            if (stalled := self._nodes.stalled()) is not None:
                self.failure = WorkerDied(stalled)
                break
        self._stop_workers(terminate=True)

    def _death(self, rank: int, error: str | None = None) -> WorkerDied:
        """The error for a worker that ended (or is ending, having reported ``error``)."""
        process = self.processes[rank - 1]
        with self._lock:
            process.join(KILL_TIMEOUT_S)
        code = process.exitcode
        how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 \
            else f"exited with code {code}"
        if error is None:
            error = last_error(self._reports[rank - 1])
        return WorkerDied(f"worker rank {rank} (pid {process.pid}) {how}" + (f": {error}" if error else ""))

    def _stop_workers(self, terminate: bool) -> None:
        """Reaps every worker: at once with SIGTERM (``terminate``), else after they exit on their own
        (the stop message); SIGKILL for any still there after the timeout."""
        with self._lock:
            stop_processes(self.processes, terminate)


def stop_processes(processes: list[BaseProcess], terminate: bool) -> None:
    """Ends ``processes``: SIGTERM first when ``terminate``, SIGKILL for any still there after the timeout."""
    if terminate:
        for process in processes:
            if process.exitcode is None:
                process.terminate()
    for process in processes:
        process.join(KILL_TIMEOUT_S if terminate else STOP_TIMEOUT_S)
        if process.exitcode is None:
            process.kill()
            process.join()


def spawn_rank(context: SpawnContext, rank: int, host: str, port: int, config: RankConfig
               ) -> tuple[BaseProcess, Connection]:
    """Starts rank ``rank``'s worker process; returns it and the read end of its report pipe."""
    reader, writer = context.Pipe(duplex=False)
    process = context.Process(target=run_rank, args=(rank, host, port, config, writer), name=f"kiln-rank{rank}",
                              daemon=True)
    process.start()
    writer.close()
    return process, reader


def last_error(report: Connection) -> str:
    """The error a worker wrote to its report pipe before ending, if any."""
    error = b""
    while report.poll() and (message := _read(report)):
        if message != READY:
            error = message
    return error.decode(errors="replace")


def _read(report: Connection) -> bytes:
    """The next message on a report pipe; empty once the worker's end is closed."""
    try:
        return report.recv_bytes()
    except (EOFError, OSError):
        return b""
