"""The scheduler process: runs ``EngineCore`` in a loop.

    python -m kiln.server.scheduler_process '{"artifact": ..., "engine": {...}, "replica": 0, "ipc_dir": ...,
                                              "parent_pid": ...}'

With ``kiln serve --dp N`` there are N of these, replicas 0..N-1, each with its own engine core, KV
cache and inbox (``ipc.scheduler_socket(replica)``); on GPUs replica i runs on its own devices
(``replica_options``). Its STATS and READY name its replica.

It loads the model, reports READY with its start-up phases (``kiln.runtime.startup``; or FATAL
when loading fails), then repeats: take every waiting ADD/ABORT, run one step while there is work,
send the step's events to the detokenizer, and publish the core's stats (every ``STATS_INTERVAL_S``
while they change). With nothing to do it captures the decode and prefill graphs that real traffic
would otherwise wait for, one between looks at its inbox. A request the core refuses is answered with
REJECT and the loop goes on; an error inside a step is fatal (the core's state is no longer
trustworthy): it reports FATAL and exits non-zero, and the HTTP process fails what is in flight and
stops; so does a worker rank's death (``EngineOptions.world_size`` > 1), idle or not. It exits on
SHUTDOWN or when its parent is gone, closing the core (its worker processes) on the way out;
SIGINT/SIGTERM are left to the parent, which drains before stopping its children.

With ``kiln serve --disaggregation-mode prefill|decode`` an ADD that names a bootstrap room goes
through ``server/disaggregation.py``: the prefill side runs it for its prompt and hands its KV pages
over; the decode side holds it until they arrive.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import asdict, replace
from typing import Any

import torch
import zmq

from kiln.runtime.engine_core import EngineCore
from kiln.runtime.engine_options import EngineOptions
from kiln.runtime.outputs import SampleEvent
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.startup import process_phases
from kiln.runtime.text.detokenizer import PROMPT_CONTEXT_TOKENS
from kiln.server import ipc
from kiln.runtime.disagg.kv_link import KVLinkError
from kiln.server.disaggregation import DecodeSide, PrefillSide
from kiln.server.stream_interval import StreamInterval

log = logging.getLogger("kiln.server.scheduler")

STATS_INTERVAL_S = 0.25
# How often a decode server holding requests for their KV pages looks for arrivals (server/disaggregation.py).
HANDOFF_POLL_MS = 2


class SchedulerLoop:
    def __init__(self, core: EngineCore, inbox: zmq.Socket, outbox: zmq.Socket, parent: ipc.ParentWatch,
                 replica: int = 0, disaggregation: str = "null", bootstrap_port: int = 0,
                 stream_interval: int = 1) -> None:
        self.core = core
        self.stream = StreamInterval(stream_interval)  # which events go out now (--stream-interval)
        # Prefill/decode disaggregation (server/disaggregation.py): at most one of these.
        self.prefill = PrefillSide(core, bootstrap_port) if disaggregation == "prefill" else None
        self.decode = DecodeSide(core, self._reject) if disaggregation == "decode" else None
        self.replica = replica
        self.inbox = inbox
        self.outbox = outbox
        self.parent = parent
        self._stats_dirty = True
        self._stats_sent_at = 0.0
        self._origins: dict[str, int] = {}  # rid -> the API server that sent it (ipc.AddOptions.origin)
        self._graphs_to_warm = True  # until EngineCore.warm_up_idle finds none left
        self._warmed = 0
        self._warm_up_s = 0.0

    def run(self) -> None:
        while self.parent.alive():
            self.core.worker.check()  # a dead worker rank ends the server, also while it is idle
            # Nothing to do: capture the next step graph (EngineCore.warm_up_idle) between looks
            # at the inbox, so a request waits for at most one capture.
            warming = self._graphs_to_warm and not self.core.has_work() and \
                not (self.decode is not None and self.decode.has_work())
            wait_ms = 0 if self.core.has_work() or warming else self._idle_wait_ms()
            if self.decode is not None and self.decode.has_work():
                wait_ms = min(wait_ms, HANDOFF_POLL_MS)  # requests waiting for their pages: look again soon
            messages = ipc.recv_ready(self.inbox, wait_ms)
            # Loads first: an API server answers a load once it is sent, and a request another API
            # server sends after that answer may arrive beside it on another pipe.
            for message in sorted(messages, key=lambda m: m[0] != ipc.LORA_LOAD):
                if not self._handle(message):
                    return
            if self.decode is not None:
                for request in self.decode.ready():
                    self._add(*request)
            if self.core.has_work():
                events = self.core.step()
                self._stats_dirty = True
                if self.prefill is not None:
                    self.prefill.after_step(events)
                self._send_events(events)
            elif warming and not messages:
                self._warm_up_one()
            self._publish_stats()
        log.info("the server process is gone; exiting")

    def _warm_up_one(self) -> None:
        began = time.monotonic()
        self._graphs_to_warm = self.core.warm_up_idle()
        if self._graphs_to_warm:
            self._warmed += 1
            self._warm_up_s += time.monotonic() - began
        elif self._warmed:
            log.info("step graphs: %d captured while idle in %.2f s", self._warmed, self._warm_up_s)

    def _handle(self, message: list[Any]) -> bool:
        kind = message[0]
        if kind == ipc.ADD:
            self._route(*message[1:])
        elif kind == ipc.ABORT:
            self._send_events(self.core.abort(message[1]))
        elif kind == ipc.LORA_LOAD:
            self._lora(self.core.load_lora, *message[1:])
        elif kind == ipc.LORA_UNLOAD:
            self._lora(self.core.unload_lora, *message[1:])
        elif kind == ipc.SHUTDOWN:
            return False
        else:
            log.warning("ignoring an unknown message %r", kind)
        self._stats_dirty = True
        return True

    def _route(self, rid: str, prompt_ids: list[int], params: dict[str, Any], wire_options: dict[str, Any]) -> None:
        """An ADD: to the core, or through the disaggregation side when the request names a bootstrap room."""
        options = ipc.AddOptions.from_wire(wire_options)
        # Kept until the request's NEW or REJECT is sent (the disaggregation side may hold it a while).
        self._origins[rid] = options.origin
        bootstrap = options.bootstrap
        if bootstrap is None or (self.prefill is None and self.decode is None):
            self._add(rid, prompt_ids, params, options.lora)
        elif options.lora is not None:
            self._reject(rid, f"model: a disaggregated request runs the base model; LoRA adapter {options.lora!r} "
                              "is served only without bootstrap_room", 400)
        elif self.prefill is not None:
            self.prefill.add(rid, prompt_ids, params, bootstrap["room"], self._add)
        else:
            self.decode.add(rid, prompt_ids, params, bootstrap["room"], bootstrap["host"], bootstrap["port"])

    def _reject(self, rid: str, message: str, status: int | None = None) -> None:
        """``status`` None: bad input (the HTTP side's 400 naming the parameter)."""
        self._send([ipc.REJECT, rid, message, status, self._origins.pop(rid, 0)])

    def _lora(self, change, *args: str) -> None:
        """A LoRA load or unload the HTTP process checked already; a failure here (the directory
        changed since) leaves the adapter unknown, so its requests are rejected by name."""
        try:
            change(*args)
        except (ValueError, LookupError) as exc:
            log.error("LoRA %s failed: %s", " ".join(args), exc)

    def _add(self, rid: str, prompt_ids: list[int], params: dict[str, Any], lora: str | None = None) -> None:
        try:
            sampling = SamplingParams(**params)
            self.core.add_request(rid, prompt_ids, sampling, lora=lora)
        except (ValueError, TypeError, LookupError) as exc:  # the HTTP side validates too; this is the last word
            self._reject(rid, str(exc))
            return
        # The detokenizer needs only the prompt's tail (context for the first tokens' text), and the
        # API server the request came from (where its outputs go).
        self._send([ipc.NEW, rid, prompt_ids[-PROMPT_CONTEXT_TOKENS:], asdict(sampling), self._origins.pop(rid, 0)])

    def _idle_wait_ms(self) -> int:
        if not self._stats_dirty:
            return ipc.IDLE_POLL_MS
        due = self._stats_sent_at + STATS_INTERVAL_S - time.monotonic()
        return max(0, min(ipc.IDLE_POLL_MS, int(due * 1000) + 1))

    def _publish_stats(self) -> None:
        now = time.monotonic()
        if self._stats_dirty and now - self._stats_sent_at >= STATS_INTERVAL_S:
            self._send([ipc.STATS, self.core.stats(), self.replica])
            self._stats_sent_at = now
            self._stats_dirty = False

    def _send_events(self, events: list[SampleEvent]) -> None:
        released = self.stream.release(events)
        if released:
            self._send([ipc.EVENTS, [ipc.event_to_wire(e) for e in released]])

    def _send(self, message: list[Any]) -> None:
        self.outbox.send(ipc.pack(message))


def main(argv: list[str] | None = None) -> int:
    main_at = time.time()
    args = argv if argv is not None else sys.argv[1:]
    replica = json.loads(args[0]).get("replica", 0)
    with ipc.worker_process(args, "scheduler", ipc.scheduler_socket(replica),
                            ipc.DETOKENIZER_SOCKET) as (config, inbox, outbox):
        startup = process_phases("scheduler" if replica == 0 else f"scheduler{replica}", main_at,
                                 config.get("spawned_at"))
        try:
            core = EngineCore(config["artifact"], replica_options(EngineOptions(**config["engine"]), replica), startup)
            if config.get("lora_modules"):
                with startup.phase("lora_modules"):
                    for name, path in config["lora_modules"].items():
                        core.load_lora(name, path)
        except Exception as exc:  # any load failure is reported the same way: a message and exit 1
            outbox.send(ipc.pack([ipc.FATAL, f"loading {config['artifact']} failed: {exc}"]))
            log.error("loading the model failed: %s", exc)
            return 1
        try:
            loop = SchedulerLoop(core, inbox, outbox, ipc.ParentWatch(config["parent_pid"]), replica,
                                 config.get("disaggregation", "null"), config.get("bootstrap_port", 0),
                                 config.get("stream_interval", 1))
        except KVLinkError as exc:  # the prefill side's bootstrap port is taken
            outbox.send(ipc.pack([ipc.FATAL, f"--disaggregation-bootstrap-port: {exc}"]))
            log.error("%s", exc)
            core.close()
            return 1
        outbox.send(ipc.pack([ipc.READY, {**model_facts(core), "replica": replica, "startup": startup.to_wire()}]))
        try:
            loop.run()
        except Exception as exc:
            log.exception("a step failed")
            outbox.send(ipc.pack([ipc.FATAL, f"the scheduler failed: {type(exc).__name__}: {exc}"]))
            return 1
        finally:
            core.close()
        return 0


def replica_options(options: EngineOptions, replica: int) -> EngineOptions:
    """The engine options of data-parallel replica ``replica``: on GPUs, its own ``world_size`` devices
    after those of the replicas before it (from the device given, cuda:0 by default); on the CPU the same."""
    device = options.resolved_device()
    if device.type != "cuda" or replica == 0:
        return options
    first = (device.index or 0) + replica * options.world_size
    last = first + options.world_size - 1
    if last >= torch.cuda.device_count():
        raise ValueError(f"replica {replica} of {options.world_size} rank(s) needs cuda:{last}, and this host has "
                         f"{torch.cuda.device_count()} GPUs; lower --dp")
    return replace(options, device=f"cuda:{first}")


def model_facts(core: EngineCore) -> dict[str, Any]:
    return {"vocab_size": core.vocab_size, "max_seq_len": core.max_seq_len, "page_size": core.page_size,
            "max_running": core.scheduler.config.max_running,
            "tokenizer_dir": str(core.artifact.tokenizer_dir) if core.artifact.tokenizer_dir else None,
            "device": str(core.runner.device),
            "lora": core.artifact.manifest.get("lora"),
            "stats": core.stats()}


if __name__ == "__main__":
    ipc.exit_now(main())
