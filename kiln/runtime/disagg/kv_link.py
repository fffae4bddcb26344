"""The wire between a prefill engine and a decode engine: a two-rank gloo process group of its own.

The prefill side hosts a ``torch.distributed.TCPStore`` on its bootstrap port (SGLang's
``--disaggregation-bootstrap-port``) and is rank 0; the decode side connects to it and is rank 1. The
group is a ``ProcessGroupGloo`` built directly on that store, not the default group, so an engine
whose own ranks already use torch.distributed can hold a link too. (gloo moves CPU tensors; a GPU
pool's pages are copied to the host on the way, see ``handoff.py``.)

One handoff is two messages, prefill -> decode: a msgpack header (an int64 length, then its bytes as
uint8: the room id, the prompt's cached token ids, the KV block's shape and dtype), then the KV block
itself. A peer that died fails the transfer (its connection closed) rather than hanging it; a peer
that hangs fails it after ``timeout``: ``KVLinkError`` either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import msgpack
import torch
import torch.distributed as dist

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
    def __init__(self, group: dist.ProcessGroup, store: dist.TCPStore, rank: int) -> None:
        self.group = group
        self.store = store  # the prefill side's store lives as long as the link
        self.rank = rank

    @classmethod
    def prefill(cls, host: str, port: int, timeout: timedelta = DEFAULT_TIMEOUT) -> "KVLink":
        """The prefill side: hosts the store on ``port`` (0: a free one, see ``port``) and waits for the decode side."""
        store = dist.TCPStore(host, port, 2, True, timeout=timeout, wait_for_workers=False)
        return cls(dist.ProcessGroupGloo(store, PREFILL_RANK, 2, timeout), store, PREFILL_RANK)

    @classmethod
    def decode(cls, host: str, port: int, timeout: timedelta = DEFAULT_TIMEOUT) -> "KVLink":
        """The decode side: joins the prefill side's store at ``host:port``."""
        store = dist.TCPStore(host, port, 2, False, timeout=timeout)
        return cls(dist.ProcessGroupGloo(store, DECODE_RANK, 2, timeout), store, DECODE_RANK)

    @property
    def port(self) -> int:
        return self.store.port

    def send(self, handoff: Handoff) -> None:
        kv = handoff.kv.detach().to("cpu").contiguous()
        header = msgpack.packb({"room": handoff.room, "token_ids": handoff.token_ids, "shape": list(kv.shape),
                                "dtype": str(kv.dtype).removeprefix("torch.")})
        self._transfer("send", torch.tensor([len(header)], dtype=torch.int64))
        self._transfer("send", torch.frombuffer(bytearray(header), dtype=torch.uint8))
        if kv.numel():  # a prompt shorter than a page has no whole page to hand over
            self._transfer("send", kv.view(torch.uint8))

    def receive(self) -> Handoff:
        length = torch.zeros(1, dtype=torch.int64)
        self._transfer("recv", length)
        raw = torch.empty(int(length.item()), dtype=torch.uint8)
        self._transfer("recv", raw)
        header = msgpack.unpackb(raw.numpy().tobytes())
        kv = torch.empty(header["shape"], dtype=getattr(torch, header["dtype"]))
        if kv.numel():
            self._transfer("recv", kv.view(torch.uint8))
        return Handoff(header["room"], header["token_ids"], kv)

    def _transfer(self, how: str, tensor: torch.Tensor) -> None:
        peer = DECODE_RANK if self.rank == PREFILL_RANK else PREFILL_RANK
        try:
            work = self.group.send([tensor], peer, 0) if how == "send" else self.group.recv([tensor], peer, 0)
            work.wait()
        except RuntimeError as exc:
            side = "decode" if peer == DECODE_RANK else "prefill"
            raise KVLinkError(f"the KV handoff to the {side} side failed (is it still running?): {exc}") from exc

