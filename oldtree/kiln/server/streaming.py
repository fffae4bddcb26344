"""Tying a generation to its HTTP connection, so that a client that leaves aborts its request.

``EventStream`` is an SSE response that closes its ``RequestStream`` however the response ends
(finished, client gone mid-stream, client gone before the first byte: Starlette cancels the body
iterator on disconnect and may do so before it ever started). ``until_disconnect`` runs a
non-streaming request's work while listening for the client's disconnect, and cancels the work
when the client leaves first.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse

from .request_stream import RequestStream

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed its connection before the response was ready."""


class EventStream(StreamingResponse):
    def __init__(self, events: AsyncIterator[str], stream: RequestStream) -> None:
        # no-cache and no proxy buffering: each event should reach the client when it is produced.
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._stream = stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.close()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """``await work``, unless the client disconnects first (then ``ClientDisconnected``)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watch):
            if not pending.done():
                pending.cancel()
    if task in done:
        return task.result()
    raise ClientDisconnected
