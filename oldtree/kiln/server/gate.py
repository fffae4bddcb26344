"""The server's front door, as plain ASGI middleware: drain refusal, API key, body size, counting.

For every HTTP request, before any route runs:
- while draining (SIGTERM), new requests get 503 (``/metrics`` stays open for scrapers);
- with an API key configured, ``Authorization: Bearer KEY`` must match (constant-time compare),
  except on ``/health``;
- the body is read here, up to ``max_body_bytes``: a larger Content-Length or a longer streamed
  body gets 413 without reaching a route; the body is then replayed to the app;
- requests are counted by endpoint and status for ``/metrics``, and the number in progress is
  kept for draining.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from .errors import APIError
from .metrics import ServerMetrics

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_WHILE_DRAINING = frozenset({"/metrics"})
NO_KEY_NEEDED = frozenset({"/health"})
# Status recorded for a request whose client left before any response started (nginx's convention).
CLIENT_CLOSED = 499


@dataclass
class ServerState:
    draining: bool = False
    active: int = 0  # requests inside the app (streaming ones until their stream ends)


class Gate:
    def __init__(self, app: ASGIApp, *, state: ServerState, metrics: ServerMetrics, endpoints: frozenset[str],
                 api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.state = state
        self.metrics = metrics
        self.endpoints = endpoints
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = CLIENT_CLOSED

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self._handle(scope, receive, send_and_note)
        finally:
            endpoint = scope["path"] if scope["path"] in self.endpoints else "other"
            self.metrics.requests.inc(endpoint=endpoint, status=str(status))

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        if self.state.draining and path not in OPEN_WHILE_DRAINING:
            await _reply(APIError(503, "the server is shutting down"), scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        if self.api_key is not None and path not in NO_KEY_NEEDED and not self._authorized(headers):
            await _reply(APIError(401, "invalid or missing API key (send Authorization: Bearer KEY)",
                                  code="invalid_api_key"), scope, receive, send)
            return
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            await _reply(self._too_large() if declared.isdigit() else APIError(400, "invalid Content-Length"),
                         scope, receive, send)
            return
        try:
            body = await self._read_body(receive)
        except _ClientGone:
            return
        if body is None:
            await _reply(self._too_large(), scope, receive, send)
            return
        self.state.active += 1
        try:
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.state.active -= 1

    def _authorized(self, headers: dict[str, bytes]) -> bool:
        value = headers.get("authorization", b"")
        scheme, _, token = value.partition(b" ")
        # compare_digest on the whole token: its time does not depend on where a guess goes wrong.
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    def _too_large(self) -> APIError:
        return APIError(413, f"request body exceeds {self.max_body_bytes} bytes", code="request_too_large")

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body; None once it passes the limit (the rest is not read)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class _ClientGone(Exception):
    """The client disconnected before its body arrived."""


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body once, then the real channel (so routes still hear the client disconnect)."""
    delivered = False

    async def replay() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _reply(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    await error.response()(scope, receive, send)
