"""The adapter registry: adapters by name in host memory, and which of them hold the device slots.

``add`` reads and checks a PEFT directory (``adapter.load_adapter``) into host memory; ``lookup``
gives a request its adapter's ``LoraEntry``, which the request keeps: ``remove`` forgets the name,
and requests already holding the entry still run to the end with it (an unloaded adapter's
requests in flight finish). The scheduler ``pin``s a request's entry when it admits the request
(into a slot: already resident, a free one, else the least recently used slot no running request
pins, which goes back to host memory) and ``unpin``s it when the request stops running; a request
whose adapter finds no slot waits. Each entry has its own prefix-cache namespace, so KV computed
under one adapter is never reused for another, for the base model, or for a later adapter loaded
under the same name.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

import torch

from kiln.lora_layout import LoraLayout

from .adapter import LoraAdapter, load_adapter

_loads = itertools.count()


class UnknownAdapter(LookupError):
    """A request or an unload names no loaded adapter."""


@dataclass(eq=False)
class LoraEntry:
    name: str
    adapter: LoraAdapter
    namespace: tuple = field(default_factory=lambda: ("lora", next(_loads)))
    slot: int = -1          # the device slot holding it, -1: host memory only
    running: int = 0        # running requests pinning the slot
    last_used: int = 0


class LoraRegistry:
    def __init__(self, layout: LoraLayout, dtype: torch.dtype, write_slot: Callable[[int, LoraAdapter], None]) -> None:
        self.layout = layout
        self.dtype = dtype
        self._write_slot = write_slot
        self._by_name: dict[str, LoraEntry] = {}
        self._slots: list[LoraEntry | None] = [None] * layout.max_loras
        self._clock = itertools.count(1)
        self.slot_loads = 0  # adapters written into a slot (first use and after eviction)

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    def add(self, name: str, path: str) -> LoraEntry:
        if not name:
            raise ValueError("lora_name: must be a non-empty name")
        if name in self._by_name:
            raise ValueError(f"lora_name: an adapter named {name!r} is already loaded; unload it first")
        entry = LoraEntry(name, load_adapter(path, self.layout, self.dtype))
        self._by_name[name] = entry
        return entry

    def remove(self, name: str) -> None:
        self.lookup(name)
        del self._by_name[name]

    def lookup(self, name: str) -> LoraEntry:
        entry = self._by_name.get(name)
        if entry is None:
            loaded = ", ".join(sorted(self._by_name)) or "none"
            raise UnknownAdapter(f"the LoRA adapter {name!r} does not exist (loaded: {loaded})")
        return entry

    def pin(self, entry: LoraEntry) -> bool:
        """Makes ``entry`` resident and pins its slot; False when every slot is pinned by others."""
        if entry.slot < 0:
            slot = self._free_slot()
            if slot is None:
                return False
            evicted = self._slots[slot]
            if evicted is not None:
                evicted.slot = -1
            self._write_slot(slot, entry.adapter)
            self._slots[slot] = entry
            entry.slot = slot
            self.slot_loads += 1
        entry.running += 1
        entry.last_used = next(self._clock)
        return True

    def unpin(self, entry: LoraEntry) -> None:
        entry.running -= 1

    def _free_slot(self) -> int | None:
        if None in self._slots:
            return self._slots.index(None)
        idle = [(entry.last_used, slot) for slot, entry in enumerate(self._slots) if entry.running == 0]
        return min(idle)[1] if idle else None
