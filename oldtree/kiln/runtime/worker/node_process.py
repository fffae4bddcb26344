"""A node > 0 of a multi-node group (``kiln serve A --nnodes N --node-rank R --dist-init-addr H:P``).

It runs no server, only its ranks: it connects to node 0's rendezvous store, reads the rank settings
node 0 published there (``nodes.read_config``; its own artifact path and device replace node 0's),
starts one worker process per local rank (the same ``rank_process`` as on node 0) and then, until
they end, adds to its heartbeat counter every ``HEARTBEAT_S`` (node 0's ``NodeWatch`` reads it).

It exits 0 when every rank ended on node 0's stop message (the server stopped), and 1 when a rank
failed or node 0 is gone (a store operation fails), stopping the other ranks first. Killing this
process ends its ranks too (they watch their parent).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from datetime import timedelta
from multiprocessing import get_context
from multiprocessing.connection import wait

import torch.distributed as dist

from .nodes import HEARTBEAT_S, heartbeat_key, parse_addr, read_config
from .ranks import last_error, spawn_rank, stop_processes

log = logging.getLogger("kiln.node")

# How long a node waits for node 0's store (node 0 may be compiling the model), one short try at a time.
START_TIMEOUT = timedelta(minutes=10)
CONNECT_ATTEMPT = timedelta(seconds=1)


def _connect(host: str, port: int) -> dist.TCPStore:
    """A client of node 0's store. Node 0 may still be compiling or loading, so its store may come up
    later: short attempts in a loop (one long attempt backs off to seconds between its retries)."""
    deadline = time.monotonic() + START_TIMEOUT.total_seconds()
    while True:
        try:
            return dist.TCPStore(host, port, is_master=False, timeout=CONNECT_ATTEMPT)
        except RuntimeError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"node 0's rendezvous at {host}:{port} did not answer in "
                                   f"{START_TIMEOUT.total_seconds():g} s (is node 0 started with the same "
                                   "--dist-init-addr?)") from None
            time.sleep(HEARTBEAT_S)


def run_node(artifact_path: str, device: str, nnodes: int, node_rank: int, dist_init_addr: str) -> int:
    """Runs node ``node_rank``'s ranks until the group ends; returns the exit code."""
    host, port = parse_addr(dist_init_addr)
    log.info("node %d: waiting for node 0 at %s:%d", node_rank, host, port)
    store = _connect(host, port)
    config = replace(read_config(store), artifact_path=artifact_path, device=device)
    if config.nnodes != nnodes:
        raise ValueError(f"nnodes: node 0 runs {config.nnodes} nodes, this one was started with --nnodes {nnodes}")
    store.add(heartbeat_key(node_rank), 1)
    context = get_context("spawn")
    ranks = config.node_ranks(node_rank)
    started = [spawn_rank(context, rank, host, port, config) for rank in ranks]
    processes = [process for process, _ in started]
    log.info("node %d: ranks %d..%d started", node_rank, ranks.start, ranks.stop - 1)
    while True:
        wait([p.sentinel for p in processes], HEARTBEAT_S)
        for rank, (process, report) in zip(ranks, started):
            if process.exitcode not in (None, 0):
                log.error("node %d: rank %d exited with code %s: %s", node_rank, rank, process.exitcode,
                          last_error(report) or "no message")
                stop_processes(processes, terminate=True)
                return 1
        if all(p.exitcode == 0 for p in processes):
            log.info("node %d: node 0 stopped the group", node_rank)
            return 0
        try:
            store.add(heartbeat_key(node_rank), 1)
        except RuntimeError as exc:  # the store lives in node 0's scheduler process
            # Its stop message may have reached the ranks just before: then they are exiting with 0.
            stop_processes(processes, terminate=False)
            if all(p.exitcode == 0 for p in processes):
                log.info("node %d: node 0 stopped the group", node_rank)
                return 0
            log.error("node %d: node 0 is gone (%s); stopped its ranks", node_rank, exc)
            return 1
