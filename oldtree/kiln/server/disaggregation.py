"""A scheduler process's side of prefill/decode disaggregation (``kiln serve --disaggregation-mode``).

SGLang's model: a router (``kiln router --pd-disaggregation``) sends each request to a prefill
server and a decode server at once, both carrying the same ``bootstrap_room`` and the prefill
server's ``bootstrap_host``/``bootstrap_port``.

- ``PrefillSide`` (``--disaggregation-mode prefill``): runs each request for one token only (the
  prompt's prefill; the token is the decode side's to produce) and, once it finishes, reads the
  prompt's cached pages (``runtime/disagg/handoff.export_prompt``) and queues them for a sender
  thread, which sends them over the ``KVLink`` it hosts on ``--disaggregation-bootstrap-port`` (the
  link waits for the decode server to connect). Its radix cache works as usual: a prompt sharing a
  prefix with an earlier one prefills only the rest.
- ``DecodeSide`` (``--disaggregation-mode decode``): connects to the bootstrap address a request
  names (once; a receiver thread then queues every handoff), holds each request until its room's
  pages arrived and are cached (``import_prompt``), then adds it as a normal request, whose prefix
  match covers the handed-over pages. A link that fails, or a room that does not arrive within
  ``ROOM_TIMEOUT_S``, fails its requests with 503 naming the prefill side.

One decode server per prefill server (the link is one pair of ranks); both serve the same artifact
on one rank (tp=1, no speculative decoding: ``runtime/disagg/support.py``, checked at start-up), and
a disaggregated request runs the base model (one naming a LoRA adapter is a 400). A request without a bootstrap room is served whole by
either server, as without disaggregation.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from datetime import timedelta
from typing import Any, Callable

from kiln.runtime.disagg.handoff import export_prompt, import_prompt
from kiln.runtime.disagg.kv_link import Handoff, KVLink, KVLinkError
from kiln.runtime.disagg.support import check_core
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.outputs import SampleEvent

log = logging.getLogger("kiln.server.disaggregation")

ROOM_TIMEOUT_S = 60.0
# The links wait as long as the servers run: for the decode server's first request (which connects it)
# and, on the decode side, for the next handoff. A peer that dies closes its connection, which fails
# the link at once; a room that never arrives fails its request after ROOM_TIMEOUT_S.
LINK_TIMEOUT = timedelta(days=3650)
# A prefill server that does not accept the link in this time fails the requests waiting on it (503 with why).
CONNECT_TIMEOUT = timedelta(seconds=ROOM_TIMEOUT_S)
UNAVAILABLE = 503


class PrefillSide:
    def __init__(self, core: EngineCore, bootstrap_port: int) -> None:
        check_core(core)
        self.core = core
        self.rooms: dict[str, tuple[int, list[int]]] = {}  # rid -> (room, prompt ids)
        self.outgoing: queue.Queue[Handoff] = queue.Queue()
        # Listening now, at start-up: a taken port fails the server's start, naming it (KVLinkError).
        self.store = KVLink.listen("0.0.0.0", bootstrap_port, LINK_TIMEOUT)
        self.link_failed = False  # then nothing more is exported: no decode server reads it
        threading.Thread(target=self._send_loop, name="kiln-kv-sender", daemon=True).start()

    def add(self, rid: str, prompt_ids: list[int], params: dict[str, Any], room: int,
            add: Callable[[str, list[int], dict[str, Any]], None]) -> None:
        self.rooms[rid] = (room, prompt_ids)
        add(rid, prompt_ids, {**params, "max_new_tokens": 1, "n": 1})

    def after_step(self, events: list[SampleEvent]) -> None:
        for event in events:
            if event.finish_reason is not None and event.rid in self.rooms:
                room, prompt_ids = self.rooms.pop(event.rid)
                if event.finish_reason != "abort" and not self.link_failed:
                    self.outgoing.put(export_prompt(self.core, room, prompt_ids))

    def _send_loop(self) -> None:
        link = KVLink.prefill(self.store, timeout=LINK_TIMEOUT, device=self.core.runner.pool.device)
        log.info("the decode server connected to the bootstrap port %d", self.store.port)
        while True:
            handoff = self.outgoing.get()
            try:
                link.send(handoff)
            except KVLinkError as exc:
                log.error("%s; no more KV handoffs from this server (restart both to pair them again)", exc)
                self.link_failed = True
                return


class DecodeSide:
    def __init__(self, core: EngineCore, reject: Callable[[str, str, int], None]) -> None:
        check_core(core)
        self.core = core
        self.reject = reject
        self.incoming: queue.Queue[Handoff | KVLinkError] = queue.Queue()
        self.address: tuple[str, int] | None = None
        self.failure: str | None = None
        self.arrived: set[int] = set()
        self.waiting: dict[int, tuple[float, str, list[int], dict[str, Any]]] = {}  # room -> request

    def add(self, rid: str, prompt_ids: list[int], params: dict[str, Any], room: int, host: str, port: int) -> None:
        if self.address is None:
            self.address = (host, port)
            threading.Thread(target=self._receive_loop, args=(host, port), name="kiln-kv-receiver",
                             daemon=True).start()
        elif self.address != (host, port):
            self.reject(rid, f"bootstrap: this decode server is paired with the prefill server at "
                             f"{self.address[0]}:{self.address[1]}, not {host}:{port}", 400)
            return
        self.waiting[room] = (time.monotonic(), rid, prompt_ids, params)

    def ready(self) -> list[tuple[str, list[int], dict[str, Any]]]:
        """Requests whose pages are cached now (add them); fails those that cannot get theirs."""
        while not self.incoming.empty():
            item = self.incoming.get()
            if isinstance(item, KVLinkError):
                self.failure = str(item)
            else:
                try:
                    import_prompt(self.core, item)
                except ValueError as exc:  # the two servers serve different artifacts: nothing will fit
                    self.failure = str(exc)
                    continue
                self.arrived.add(item.room)
        released = []
        now = time.monotonic()
        for room, (since, rid, prompt_ids, params) in list(self.waiting.items()):
            if room in self.arrived:
                self.arrived.discard(room)
                released.append((rid, prompt_ids, params))
            elif self.failure is not None or now - since > ROOM_TIMEOUT_S:
                why = self.failure or f"its KV did not arrive within {ROOM_TIMEOUT_S:g} s"
                self.reject(rid, f"the prefill server is unavailable: {why}", UNAVAILABLE)
            else:
                continue
            del self.waiting[room]
        return released

    def has_work(self) -> bool:
        return bool(self.waiting)

    def _receive_loop(self, host: str, port: int) -> None:
        try:
            link = KVLink.decode(host, port, timeout=LINK_TIMEOUT, device=self.core.runner.pool.device,
                                 connect_timeout=CONNECT_TIMEOUT)
            while True:
                self.incoming.put(link.receive())
        except (KVLinkError, RuntimeError) as exc:
            self.incoming.put(exc if isinstance(exc, KVLinkError) else KVLinkError(str(exc)))

