"""What the API server processes (``kiln serve --api-server-count N``) ask one another.

Each HTTP process has its own tokenizer manager and its own copy of two things that are the
server's: the HTTP-side metrics (a scrape of any one answers for all: it asks the others for their
series and sums them) and the LoRA adapters served (the one that loads or unloads an adapter tells
the others, and answers its client once every one of them has it). They talk over the inboxes the
detokenizer's outputs arrive on (``ipc.http_socket``):

    ASK [token, asker, question, *args]   API server -> every other one
    ANSWER [token, answer]                the answer, back to the asker's inbox
    READY {"api_server": j}               API server j -> API server 0, once it listens
    READY {"startup": report}             API server 0 -> the others once it listens (``http_process.run_http``)

A question's handler runs on the answering process's event loop and returns plain data at once.
With one API server there is no one to ask: ``ask_all`` returns at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any, Callable

import zmq

from . import ipc
from .errors import APIError

log = logging.getLogger("kiln.server")

# An API server answers between two of its event loop's callbacks: milliseconds even when busy. One
# that takes this long is stuck or gone (and a gone one ends the server).
ASK_TIMEOUT_S = 10.0

METRICS = "metrics"


class Peers:
    def __init__(self, me: int = 0, others: dict[int, zmq.Socket] | None = None,
                 timeout_s: float = ASK_TIMEOUT_S) -> None:
        """``me``: this API server's index; ``others``: a PUSH socket to each other one's inbox, by index."""
        self.me = me
        self._others = others or {}
        self._timeout_s = timeout_s
        self._handlers: dict[str, Callable[..., Any]] = {}
        self._pending: dict[int, tuple[asyncio.Future[None], list[Any]]] = {}
        self._tokens = itertools.count()
        self.ready: set[int] = set()  # the API servers that said READY (API server 0 counts them)

    @property
    def count(self) -> int:
        """API servers in the server, this one included."""
        return len(self._others) + 1

    def answer(self, question: str, handler: Callable[..., Any]) -> None:
        """Answers ``question`` from the others with ``handler(*args)``."""
        self._handlers[question] = handler

    async def ask_all(self, question: str, *args: Any) -> list[Any]:
        """Every other API server's answer (in no particular order); 503 when one does not answer."""
        if not self._others:
            return []
        token = next(self._tokens)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        answers: list[Any] = []
        self._pending[token] = (done, answers)
        data = ipc.pack([ipc.ASK, token, self.me, question, *args])
        for socket in self._others.values():
            socket.send(data)
        try:
            await asyncio.wait_for(done, self._timeout_s)
        except asyncio.TimeoutError:
            raise APIError(503, f"{len(self._others) - len(answers)} of the other API servers did not answer "
                                f"{question!r} in {self._timeout_s:g} s") from None
        finally:
            del self._pending[token]
        return answers

    def close(self) -> None:
        for socket in self._others.values():
            socket.close(linger=0)

    def tell(self, api_server: int, message: list[Any]) -> None:
        self._others[api_server].send(ipc.pack(message))

    def handle(self, message: list[Any]) -> bool:
        """Takes a message of the API servers' own; says whether it was one."""
        kind = message[0]
        if kind == ipc.ASK:
            token, asker, question, *args = message[1:]
            self.tell(asker, [ipc.ANSWER, token, self._handlers[question](*args)])
        elif kind == ipc.ANSWER:
            pending = self._pending.get(message[1])
            if pending is None:
                log.warning("an answer came after its question timed out")
                return True
            done, answers = pending
            answers.append(message[2])
            if len(answers) == len(self._others):
                done.set_result(None)
        elif kind == ipc.READY and "api_server" in message[1]:
            self.ready.add(message[1]["api_server"])
        else:
            return False
        return True
