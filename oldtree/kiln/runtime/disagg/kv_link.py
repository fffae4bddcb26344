"""The wire between a prefill engine and a decode engine: a two-rank process group of its own.

The prefill side hosts a ``torch.distributed.TCPStore`` on its bootstrap port (SGLang's
``--disaggregation-bootstrap-port``; ``listen``, at start-up) and is rank 0; the decode side connects to it and is rank 1. The
groups are built directly on that store, not the default group, so an engine whose own ranks already
use torch.distributed can hold a link too:

- a ``ProcessGroupGloo``, always: the headers, and the KV on the CPU;
- a ``ProcessGroupNCCL`` (on a prefix of the same store) when both sides' pools are on GPUs, which
  each side tells the other once the gloo group is up: the KV then goes GPU to GPU, never through
  host memory. Otherwise (a CPU side) the KV is copied to the host and travels on gloo.

One handoff is two messages, prefill -> decode: a msgpack header on gloo (an int64 length, then its
bytes as uint8: the room id, the prompt's cached token ids, the KV block's shape and dtype), then the
KV block itself. A peer that died fails a gloo transfer (its connection closed) rather than hanging
it; a peer that hangs fails it after ``timeout``: ``KVLinkError`` either way. On NCCL a peer that dies
between a header and its block is found by NCCL's own timeout; the next header finds it at once.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta

import msgpack
import torch
import torch.distributed as dist

from ..worker.nccl_env import keep_multicast_off

PREFILL_RANK, DECODE_RANK = 0, 1
DEFAULT_TIMEOUT = timedelta(seconds=60)


class KVLinkError(RuntimeError):
    """The other side of the link is gone or stopped answering."""


@dataclass(frozen=True)
class Handoff:
    """A prefilled prompt's KV: ``kv`` is ``[layers, 2, len(token_ids), kv_heads, head_dim]``, the K and V
    of each of ``token_ids`` (whole pages of the prompt) in every layer."""

    room: int
    token_ids: list[int]
    kv: torch.Tensor


class KVLink:
    def __init__(self, group: dist.ProcessGroup, store: dist.TCPStore, rank: int,
                 device: torch.device = torch.device("cpu")) -> None:
        self.group = group
        self.store = store  # the prefill side's store lives as long as the link
        self.rank = rank
        self.peer = DECODE_RANK if rank == PREFILL_RANK else PREFILL_RANK
        # The KV's own wire: NCCL between two GPU pools (agreed with the peer), else gloo through the host.
        self.device = device
        self.device_group: dist.ProcessGroup | None = None
        if self._both_on_gpus():
            keep_multicast_off()  # before the communicator exists
            self.device_group = dist.ProcessGroupNCCL(dist.PrefixStore("kiln/kv_nccl", store), rank, 2)

    @staticmethod
    def listen(host: str, port: int, timeout: timedelta = DEFAULT_TIMEOUT) -> dist.TCPStore:
        """The prefill side's store, listening on ``port`` (0: a free one) before any decode side comes, so
        a port that is taken fails at once, naming it, rather than leaving every handoff unsent."""
        try:
            return dist.TCPStore(host, port, 2, True, timeout=timeout, wait_for_workers=False)
        except RuntimeError as exc:
            raise KVLinkError(f"cannot listen for the decode side on {host}:{port}: {exc}") from exc

    @classmethod
    def prefill(cls, store: dist.TCPStore, timeout: timedelta = DEFAULT_TIMEOUT,
                device: torch.device = torch.device("cpu")) -> "KVLink":
        """The prefill side: waits on ``store`` (``listen``'s) for the decode side to connect. ``device``:
        where the KV it sends lives (its pool's)."""
        return cls(dist.ProcessGroupGloo(store, PREFILL_RANK, 2, timeout), store, PREFILL_RANK, device)

    @classmethod
    def decode(cls, host: str, port: int, timeout: timedelta = DEFAULT_TIMEOUT,
               device: torch.device = torch.device("cpu"), connect_timeout: timedelta | None = None) -> "KVLink":
        """The decode side: joins the prefill side's store at ``host:port``, giving up after
        ``connect_timeout`` (``timeout`` when None) with a ``KVLinkError`` naming the address. ``device``:
        where the KV it receives should live (its pool's)."""
        try:
            store = dist.TCPStore(host, port, 2, False, timeout=connect_timeout or timeout)
        except RuntimeError as exc:
            raise KVLinkError(f"cannot reach the prefill side's bootstrap port {host}:{port}: {exc}") from exc
        store.set_timeout(timeout)
        return cls(dist.ProcessGroupGloo(store, DECODE_RANK, 2, timeout), store, DECODE_RANK, device)

    @property
    def port(self) -> int:
        return self.store.port

    def send(self, handoff: Handoff) -> None:
        kv = handoff.kv.detach()
        kv = (kv.to(self.device) if self.device_group is not None else kv.to("cpu")).contiguous()
        header = msgpack.packb({"room": handoff.room, "token_ids": handoff.token_ids, "shape": list(kv.shape),
                                "dtype": str(kv.dtype).removeprefix("torch.")})
        self._transfer("send", torch.tensor([len(header)], dtype=torch.int64))
        self._transfer("send", torch.frombuffer(bytearray(header), dtype=torch.uint8))
        if kv.numel():  # a prompt shorter than a page has no whole page to hand over
            self._transfer("send", kv.view(torch.uint8))

    def receive(self) -> Handoff:
        """The next handoff; its KV on this side's device when it came over NCCL, else on the CPU."""
        length = torch.zeros(1, dtype=torch.int64)
        self._transfer("recv", length)
        raw = torch.empty(int(length.item()), dtype=torch.uint8)
        self._transfer("recv", raw)
        header = msgpack.unpackb(raw.numpy().tobytes())
        kv = torch.empty(header["shape"], dtype=getattr(torch, header["dtype"]),
                         device=self.device if self.device_group is not None else "cpu")
        if kv.numel():
            self._transfer("recv", kv.view(torch.uint8))
        return Handoff(header["room"], header["token_ids"], kv)

    def _both_on_gpus(self) -> bool:
        """Whether this side's and the peer's devices are both GPUs: the prefill side's flag goes first (a
        gloo send completes only once the peer receives it)."""
        mine = torch.tensor([int(self.device.type == "cuda")], dtype=torch.int64)
        theirs = torch.zeros(1, dtype=torch.int64)
        for how in ("send", "recv") if self.rank == PREFILL_RANK else ("recv", "send"):
            self._transfer(how, mine if how == "send" else theirs)
        return bool(mine.item() and theirs.item())

    def _transfer(self, how: str, tensor: torch.Tensor) -> None:
        on_gpu = tensor.device.type == "cuda"
        group = self.device_group if on_gpu else self.group
        try:
            with torch.cuda.device(tensor.device) if on_gpu else contextlib.nullcontext():
                work = group.send([tensor], self.peer, 0) if how == "send" else group.recv([tensor], self.peer, 0)
                work.wait()
                if on_gpu:
                    # This thread's stream waited for NCCL's; the block is whole before another thread reads
                    # it (the decode side imports it on the scheduler's thread), or the sender reuses it.
                    torch.cuda.current_stream(tensor.device).synchronize()
        except RuntimeError as exc:
            side = "decode" if self.peer == DECODE_RANK else "prefill"
            raise KVLinkError(f"the KV handoff to the {side} side failed (is it still running?): {exc}") from exc
