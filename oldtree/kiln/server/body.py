"""Request bodies: JSON parsed off the event loop and checked before any route or schema sees it.

A body up to the size limit (8 MiB) can take seconds to parse and validate, which on the event loop
would stall every other request and ``/health``. ``CheckedRoute`` parses JSON bodies in a worker
thread and checks, there too:
- the body is UTF-8 and JSON (code ``invalid_encoding`` / ``invalid_json``);
- it nests at most ``max_depth`` levels (``nesting_too_deep``), and ``messages`` (or the Responses
  API's ``input``) holds at most ``max_messages`` items (``too_many_messages``), so what follows
  (pydantic, the chat template) works on a bounded body;
- every string, keys included, is valid Unicode (``invalid_unicode``): a lone UTF-16 surrogate
  (``"\\ud800"``) is refused, never replaced, naming where it is (``messages[0].content``);
- every number is finite (``invalid_number``): Python's JSON reader takes ``NaN`` and ``Infinity``,
  which no parameter means.
FastAPI then validates the parsed value as usual (``Request.json`` returns it).
"""

from __future__ import annotations

import asyncio
import email.message
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Coroutine

from fastapi import Request, Response
from fastapi.routing import APIRoute

from kiln.runtime.text.user_text import first_surrogate

from .errors import APIError, param_path

# Only a \uD800-\uDFFF escape in the raw body can put a surrogate into a parsed string (raw UTF-8
# cannot encode one); bodies without such an escape skip the per-string check.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
_LISTS_OF_MESSAGES = ("messages", "input")


@dataclass(frozen=True)
class BodyLimits:
    max_depth: int = 64
    max_messages: int = 4096


def parse_body(body: bytes, limits: BodyLimits) -> Any:
    """The checked JSON value of ``body``; an ``APIError`` (400) saying what is wrong otherwise."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {error.start}: {error.reason})",
                       code="invalid_encoding") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise APIError(400, f"the request body is not valid JSON: {error.msg} (line {error.lineno}, column "
                            f"{error.colno})", code="invalid_json") from None
    except RecursionError:
        raise _too_deep(None, limits.max_depth) from None
    if isinstance(data, dict):
        for name in _LISTS_OF_MESSAGES:
            items = data.get(name)
            if isinstance(items, list) and len(items) > limits.max_messages:
                raise APIError(400, f"{name}: {len(items)} items; at most {limits.max_messages} are accepted",
                               param=name, code="too_many_messages")
    _walk(data, limits.max_depth, bool(_SURROGATE_ESCAPE.search(body)))
    return data


def _walk(data: Any, max_depth: int, check_text: bool) -> None:
    # Iterative: a deep body must not exhaust this thread's stack.
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            param = param_path(path)
            raise APIError(400, f"{param or 'the request body'}: {value} is not a number; send a finite number",
                           param=param, code="invalid_number")
        if isinstance(value, str):
            if check_text and (index := first_surrogate(value)) is not None:
                raise _not_unicode(path, value, index)
            continue
        if isinstance(value, (dict, list)) and len(path) >= max_depth:
            raise _too_deep(path, max_depth)
        if isinstance(value, dict):
            for key, item in value.items():
                if check_text and (index := first_surrogate(key)) is not None:
                    raise _not_unicode(path, key, index, in_key=True)
                stack.append((item, path + (key,)))
        elif isinstance(value, list):
            stack.extend((item, path + (index,)) for index, item in enumerate(value))


def _not_unicode(path: tuple[str | int, ...], text: str, index: int, in_key: bool = False) -> APIError:
    param = param_path(path)
    where = f"{param}: " if param else ""
    what = "a key" if in_key else "text"
    return APIError(400, f"{where}{what} is not valid Unicode: a lone UTF-16 surrogate (U+{ord(text[index]):04X}) "
                         f"at character {index}; it is refused, not replaced", param=param, code="invalid_unicode")


def _too_deep(path: tuple[str | int, ...] | None, max_depth: int) -> APIError:
    param = param_path(path) if path else None
    where = f" at {param}" if param else ""
    return APIError(400, f"the request body nests deeper than {max_depth} levels{where}", param=param,
                    code="nesting_too_deep")


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return True  # FastAPI reads a body without a content type as JSON
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def checked_route(limits: BodyLimits) -> type[APIRoute]:
    """An ``APIRoute`` class whose JSON bodies are parsed and checked in a worker thread."""

    class CheckedRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def checked(request: Request) -> Response:
                body = await request.body()
                if body and _is_json(request.headers.get("content-type")):
                    # Request.json returns this (starlette caches the parsed body under _json).
                    request._json = await asyncio.to_thread(parse_body, body, limits)
                return await handler(request)

            return checked

    return CheckedRoute
