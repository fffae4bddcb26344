"""ZMQ + msgpack plumbing between the server's three processes.

    HTTP process --PUSH--> scheduler<i>.sock --PULL-- scheduler process i (one per replica, ``--dp``)
    schedulers   --PUSH--> detokenizer.sock --PULL-- detokenizer process
    detokenizer  --PUSH--> http<j>.sock --PULL-- HTTP process j (one per API server, ``--api-server-count``)
    HTTP process --PUSH--> http<j>.sock           (the API servers ask one another: ``peers.py``)

Each receiver binds its socket in a private temporary directory (``ipc://``, never TCP); the
scheduler and detokenizer processes open theirs through ``worker_process``. A message
is one msgpack array whose first item names its kind (the constants below). msgpack carries only
plain data (no pickle, no ext types), so nothing a request sends can execute code on the way.

Messages:
    ADD [rid, prompt_ids, params, options]  HTTP -> the routed replica's scheduler; params is ``SamplingParams``
                                       as a dict, options an ``AddOptions`` as a map of the fields set (the
                                       adapter, the bootstrap room, the sending API server: its origin)
    LORA_LOAD [name, path]             HTTP -> every scheduler: serve the PEFT adapter at path as name
    LORA_UNLOAD [name]                 HTTP -> every scheduler: forget it (its requests in flight finish)
    ABORT [rid]                        HTTP -> scheduler
    SHUTDOWN []                        HTTP -> scheduler, HTTP -> detokenizer
    NEW [rid, prompt_tail, params, origin]
                                       scheduler -> detokenizer, before any event of rid
    EVENTS [[event...]]                scheduler -> detokenizer (``event_to_wire``)
    OUTPUTS [[output...]]              detokenizer -> the requests' API server (``detokenizer_process`` builds them)
    REJECT [rid, message, status, origin]
                                       the scheduler refused a request: bad input when status is None (a 400),
                                       else that HTTP status (a disaggregation peer gone); forwarded to the
                                       request's API server (its ADD's origin)
    STATS [{name: number}, replica]    EngineCore.stats() of one replica; forwarded to every API server
    READY {model facts}                a scheduler loaded the model (facts name its replica); forwarded to API
                                       server 0 (the launcher) once the detokenizer is ready too; an API server
                                       started later says READY {"api_server": j} to API server 0 once it listens,
                                       and API server 0 then READY {"startup": report} to each (its /health report)
    MODELS [[model facts, ...]]        API server 0 -> each API server it started: every replica is READY (their
                                       facts, in replica order); they start while the model loads and wait for it
    FATAL [message]                    a process cannot go on; forwarded to every API server, then the sender exits
    ASK [token, asker, question, ...]  API server -> the others (``peers.py``: metrics, LoRA adapters)
    ANSWER [token, answer]             back to the asker
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterator, NoReturn, Sequence

import msgpack
import zmq

from kiln.runtime.outputs import SampleEvent

DETOKENIZER_SOCKET = "detokenizer.sock"

ADD, ABORT, SHUTDOWN = "add", "abort", "shutdown"
LORA_LOAD, LORA_UNLOAD = "lora_load", "lora_unload"
NEW, EVENTS, OUTPUTS, REJECT = "new", "events", "outputs", "reject"
STATS, READY, MODELS, FATAL = "stats", "ready", "models", "fatal"
ASK, ANSWER = "ask", "answer"

# Children wake at least this often when idle, to notice that their parent is gone.
IDLE_POLL_MS = 500
# Pending messages are flushed for at most this long when a socket closes at shutdown.
LINGER_MS = 1000


@dataclass(frozen=True)
class AddOptions:
    """An ADD's optional parts. On the wire a map of the fields set, by name, so that a feature adds
    its field here without moving another's; a name left out reads as its default."""

    lora: str | None = None                   # the LoRA adapter's name (None: the base model)
    bootstrap: dict[str, Any] | None = None   # a disaggregated request's room and prefill address
    origin: int = 0                           # the sending API server (``--api-server-count``): its outputs go there

    def to_wire(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> "AddOptions":
        return cls(**wire)


def scheduler_socket(replica: int) -> str:
    return f"scheduler{replica}.sock"


def http_socket(api_server: int) -> str:
    return f"http{api_server}.sock"


def address(ipc_dir: str | os.PathLike[str], name: str) -> str:
    return f"ipc://{Path(ipc_dir) / name}"


def pack(message: list[Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes) -> list[Any]:
    # strict_map_key=False: logit_bias maps integer token ids to biases.
    message = msgpack.unpackb(data, raw=False, strict_map_key=False)
    if not isinstance(message, list) or not message or not isinstance(message[0], str):
        raise ValueError("malformed IPC message")
    return message


def push_socket(context: zmq.Context, addr: str) -> zmq.Socket:
    """A sending socket. No high-water mark: a send never blocks (a dead receiver is noticed by the
    parent, which stops every process, rather than by a sender stuck in ``send``)."""
    socket = context.socket(zmq.PUSH)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.LINGER, LINGER_MS)
    socket.connect(addr)
    return socket


def pull_socket(context: zmq.Context, addr: str) -> zmq.Socket:
    socket = context.socket(zmq.PULL)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(addr)
    return socket


@contextlib.contextmanager
def worker_process(argv: list[str], role: str, inbox_name: str,
                   outbox_name: str) -> Iterator[tuple[dict[str, Any], zmq.Socket, zmq.Socket]]:
    """What the scheduler and detokenizer processes start with: their JSON config (``argv[0]``, from
    the launcher), logging that names ``role``, SIGINT and SIGTERM ignored, and their inbox (bound)
    and outbox sockets, closed with their context when the block ends."""
    config = json.loads(argv[0])
    logging.basicConfig(level=config.get("log_level", "INFO").upper(), format=f"kiln {role}: %(message)s")
    # Ctrl-C reaches the whole process group; the HTTP process decides how to stop (it drains first).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    context = zmq.Context()
    inbox = pull_socket(context, address(config["ipc_dir"], inbox_name))
    outbox = push_socket(context, address(config["ipc_dir"], outbox_name))
    try:
        yield config, inbox, outbox
    finally:
        inbox.close()
        outbox.close()
        context.term()


def recv_ready(socket: zmq.Socket, timeout_ms: int) -> list[list[Any]]:
    """Every message waiting on ``socket``, waiting up to ``timeout_ms`` for the first one."""
    messages: list[list[Any]] = []
    if not socket.poll(timeout_ms):
        return messages
    while True:
        try:
            messages.append(unpack(socket.recv(zmq.NOBLOCK)))
        except zmq.Again:
            return messages


def event_to_wire(event: SampleEvent) -> Sequence[Any]:
    """An event as msgpack writes it: a ``SampleEvent`` without logprobs as it is (a NamedTuple of plain
    values, written as the array below: the scheduler sends one a running sample a step, and building
    the list costs more than packing it), else with its ``TokenLogprob`` records as arrays."""
    if not event.logprobs:
        return event
    return [event.rid, event.index, list(event.token_ids),
            [[lp.token_id, lp.logprob, [list(t) for t in lp.top]] for lp in event.logprobs],
            event.finish_reason, event.error, event.prompt_tokens, event.cached_tokens, event.spec_verify_ct,
            event.spec_verify_tokens, list(event.prompt_logprobs), event.matched_stop]


def exit_now(code: int) -> NoReturn:
    """Ends this process with ``code`` at once, once everything it owns is closed: logs and standard
    streams are flushed, the interpreter's teardown is skipped. That teardown (freeing torch's modules)
    costs seconds of CPU -- about 2 s for a process that only imported torch, on a busy 2-core machine
    -- and a server stopping because a child died, or a child told to stop, would wait for it."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class ParentWatch:
    """Tells a child process whether the process that started it still runs (an orphan is
    re-parented, so its parent pid changes)."""

    def __init__(self, parent_pid: int) -> None:
        self.parent_pid = parent_pid

    def alive(self) -> bool:
        return os.getppid() == self.parent_pid
