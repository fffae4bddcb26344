"""A worker process: rank r > 0 of a multi-rank engine (started by ``ranks.WorkerGroup``).

It builds its own model runner on its device, reports READY to the core through its report pipe
and joins the process group (in the order ``load_and_join`` gives), then runs every step rank 0
broadcasts until the stop message. Its result is not used: rank 0's is the step's. A
tensor-parallel artifact's program runs its collectives inside the forward, so every rank's forward
is needed for rank 0's to finish; a replicated one's ranks each run the whole model.

It ends with the core in every case: on the stop message (exit 0); on an error, which it writes to
its report pipe for the core's message before exiting 1 (``EXIT_ERROR``); and when the core's
process is gone, seen through multiprocessing's parent sentinel (not PR_SET_PDEATHSIG, which fires
when the *thread* that started the process ends, and an engine may be built on a short-lived
thread). SIGINT is ignored: a Ctrl-C in a terminal reaches every process of the group, and the core
decides what it means.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Callable

import torch
import torch.distributed as dist

from ..artifact import load_artifact
from .model_runner import ModelRunner
from .rank_grid import join_groups
from .step_wire import receive_step
from .worker import RankConfig

READY = b"ready"
HOST = "127.0.0.1"
# Waiting for every rank to reach the rendezvous, once all have loaded their model.
RENDEZVOUS_TIMEOUT = timedelta(seconds=60)
# Effectively none: a worker waits for its next step for as long as the engine is idle. A dead rank
# is found by other means, at once: the core watches its workers' exits, gloo fails a transfer whose
# peer's connection closed, and a worker leaves when the core's process is gone.
COLLECTIVE_TIMEOUT = timedelta(days=3650)
EXIT_ERROR = 1
EXIT_PARENT_GONE = 70


def join_group(rank: int, store: dist.Store, config: RankConfig) -> None:
    """Makes this process rank ``rank`` of torch.distributed's default group."""
    backend = "cpu:gloo,cuda:nccl" if config.rank_device(rank).type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=config.world_size,
                            timeout=COLLECTIVE_TIMEOUT)
    if config.pp > 1:  # the stages' tp groups and the pp groups between them
        join_groups(config.grid, rank)


def load_and_join(rank: int, store: dist.Store, config: RankConfig, load: Callable[[], ModelRunner],
                  ready: Callable[[], None]) -> ModelRunner:
    """Loads this rank's model runner (``load``), says so (``ready``) and joins the group, in the order
    the artifact needs. A tensor-parallel runner's warm-up and CUDA-graph capture run the program's
    collectives, so its ranks join the group first; a replicated one's ranks load first, so that a
    rank failing to load is reported at once rather than after the rendezvous times out."""
    if config.tensor_parallel:
        join_group(rank, store, config)
    runner = load()
    ready()
    if not config.tensor_parallel:
        join_group(rank, store, config)
    return runner


def run_rank(rank: int, host: str, port: int, config: RankConfig, report: Connection) -> None:
    """The worker process's main (a ``multiprocessing`` spawn target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    try:
        device = config.rank_device(rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = dist.TCPStore(host, port, config.world_size, False, timeout=RENDEZVOUS_TIMEOUT)
        runner = load_and_join(rank, store, config,
                               lambda: config.build_runner(load_artifact(config.artifact_path), rank),
                               lambda: report.send_bytes(READY))
        while (lists := receive_step()) is not None:
            if device.type == "cuda":
                # The step buffers assume what rank 0 does: it reads each step's tokens before it
                # stages the next, so no staging overwrites inputs an unfinished step still reads.
                torch.cuda.current_stream().synchronize()
            runner.forward(lists)
    except BaseException as exc:
        traceback.print_exc()
        try:
            report.send_bytes(f"{type(exc).__name__}: {exc}".encode())
        finally:
            sys.stderr.flush()
            # Not SystemExit: tearing the interpreter down while the group's threads run can abort
            # (SIGABRT), and the exit code is what the core reports.
            os._exit(EXIT_ERROR)
    dist.destroy_process_group()


def _exit_with_parent() -> None:
    """Ends this process as soon as the core's process ends, whatever this one is doing."""
    parent = multiprocessing.parent_process()

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(EXIT_PARENT_GONE)

    threading.Thread(target=watch, name="kiln-parent-watch", daemon=True).start()
