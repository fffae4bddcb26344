"""A step's lists on the wire, from rank 0 to the other ranks, over torch.distributed's broadcast.

Each step is two broadcasts from rank 0: an int64 length, then that many bytes (a uint8 tensor) of
msgpack, never pickle. The bytes map each column the step fills (``StepLists`` holds one per
step-schema field it uses, see ``kiln.step_schema``) to its values, so a field added to the schema
travels with no change here; host-only attributes (the ``Request`` objects) stay behind and arrive
empty. A length of 0 is the stop message: no step encodes to zero bytes.

The tensors are on the CPU, so the broadcasts take gloo, also where the group's device collectives
take NCCL (the group's backend is "cpu:gloo,cuda:nccl" on a GPU).
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch
import torch.distributed as dist

from ..scheduler.batch import StepLists

# Attributes that hold host objects, not step data; workers get them empty.
HOST_ONLY = frozenset({"requests", "prompt_rows"})


def encode(lists: StepLists) -> bytes:
    return msgpack.packb({name: column for name, column in vars(lists).items() if name not in HOST_ONLY})


def decode(data: Any) -> StepLists:
    """The lists ``encode`` wrote (``data``: bytes or any buffer), host-only attributes empty."""
    return StepLists(**msgpack.unpackb(data), **{name: [] for name in HOST_ONLY})


def send_step(lists: StepLists | None) -> None:
    """On rank 0: broadcasts ``lists``, or the stop message when None."""
    payload = b"" if lists is None else encode(lists)
    dist.broadcast(torch.tensor([len(payload)], dtype=torch.int64), src=0)
    if payload:
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0)


def receive_step() -> StepLists | None:
    """On ranks > 0: the next step rank 0 sends, or None when it says stop."""
    length = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(length, src=0)
    if not length.item():
        return None
    data = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.broadcast(data, src=0)
    return decode(data.numpy())
