"""Ranks spread over machines: SGLang's ``--nnodes N --node-rank R --dist-init-addr HOST:PORT``.

A group of W ranks (pp x max(tp, ep), ``rank_grid.py``) over N nodes puts ranks n*W/N..(n+1)*W/N-1
on node n: a contiguous range, so the grid's tp/pp groups are those of one node. Node 0
runs the server (HTTP, scheduler, rank 0 and its local ranks) and hosts the group's rendezvous: a
``torch.distributed.TCPStore`` listening on ``dist_init_addr``, where every rank meets the others
through ``init_process_group`` as on one machine (no transport of kiln's own). Nodes > 0 run only
their ranks (``node_process.run_node``): they read the rank settings node 0 publishes in the store
(``publish_config``), so every rank builds the same runner, then start their rank processes.

Liveness: a rank on another machine has no process sentinel node 0 could wait on, so every node > 0
adds to its counter in the store every ``HEARTBEAT_S``; node 0's ``NodeWatch`` reports a node whose
counter has not moved for ``NODE_TIMEOUT_S`` (the server then ends, naming the node). A node > 0
ends when a store operation fails (node 0 is gone), and its ranks' next broadcast fails too.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict

import torch.distributed as dist

from .worker import RankConfig

HEARTBEAT_S = 0.5
NODE_TIMEOUT_S = 3.0
CONFIG_KEY = "kiln/rank_config"


def parse_addr(addr: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 hosts in brackets, as ``[::1]:5000``) as (host, port)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"dist_init_addr: expected HOST:PORT (e.g. 10.0.0.1:5000), got {addr!r}")
    return host.strip("[]"), int(port)


def check_layout(world_size: int | None, nnodes: int, node_rank: int, dist_init_addr: str | None) -> None:
    """Raises ValueError naming what is wrong with a multi-node layout (``world_size`` None: not known
    here, as on a node > 0, which learns it from node 0)."""
    if nnodes < 1:
        raise ValueError(f"nnodes: must be at least 1, not {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank: must be in 0..{nnodes - 1} (nnodes {nnodes}), not {node_rank}")
    if nnodes == 1:
        return
    if dist_init_addr is None:
        raise ValueError("dist_init_addr: nnodes > 1 needs the HOST:PORT of node 0's rendezvous (--dist-init-addr)")
    parse_addr(dist_init_addr)
    if world_size is not None and (world_size % nnodes or world_size < nnodes):
        raise ValueError(f"nnodes: {world_size} rank(s) cannot be spread evenly over {nnodes} nodes; "
                         "the ranks (pp x max(tp, ep)) must be a multiple of --nnodes")


def heartbeat_key(node: int) -> str:
    return f"kiln/heartbeat/{node}"


def publish_config(store: dist.Store, config: RankConfig) -> None:
    """On node 0: the settings every other node's ranks build their runners from."""
    store.set(CONFIG_KEY, json.dumps(asdict(config)))


def read_config(store: dist.Store) -> RankConfig:
    """On a node > 0: node 0's rank settings (waits until node 0 has published them)."""
    fields = json.loads(store.get(CONFIG_KEY))
    fields["decode_buckets"] = tuple(fields["decode_buckets"])
    return RankConfig(**fields)


class NodeWatch:
    """On node 0: whether every other node's heartbeat still moves (through its own store client)."""

    def __init__(self, config: RankConfig) -> None:
        host, port = parse_addr(config.dist_init_addr)
        self.config = config
        self.store = dist.TCPStore(host, port, is_master=False)
        now = time.monotonic()
        self.seen = {node: (-1, now) for node in range(1, config.nnodes)}

    def stalled(self) -> str | None:
        """Why a node counts as gone (its heartbeat stopped), or None while all are alive."""
        now = time.monotonic()
        for node, (count, since) in self.seen.items():
            current = self.store.add(heartbeat_key(node), 0)
            if current != count:
                self.seen[node] = (current, now)
            elif now - since > NODE_TIMEOUT_S:
                ranks = self.config.node_ranks(node)
                return (f"node {node} (ranks {ranks.start}..{ranks.stop - 1}) stopped answering: no heartbeat "
                        f"for {NODE_TIMEOUT_S:g} s")
        return None
