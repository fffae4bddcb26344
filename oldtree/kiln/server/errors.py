"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with a fitting status.

Every failure the server reports goes through ``APIError`` (raised by the routes) or one of the
handlers installed here (FastAPI's validation errors, Starlette's HTTP errors, anything
unexpected). Client errors are deterministic, so they carry ``x-should-retry: false`` and the
official clients do not resend them.

Every error names a stable ``code``: the raiser's (``context_length_exceeded``, ``invalid_unicode``,
``model_not_found``...), else one for its kind (``missing_required_parameter``, ``invalid_type``,
``invalid_value``) or its status (``not_found``, ``service_unavailable``...), never null.
"""

from __future__ import annotations

import logging
from dataclasses import fields
from typing import Any, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kiln.runtime.sampling import SamplingParams

log = logging.getLogger("kiln.server")

# Names a runtime error message may start with (the engine names the parameter first).
_KNOWN_PARAMS = {f.name for f in fields(SamplingParams)} | {"prompt"}
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "internal_server_error",
          503: "service_unavailable"}
_STATUS_CODES = {400: "invalid_value", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
                 413: "request_too_large", 500: "internal_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None) -> None:
        """``retry_after``: seconds a client should wait before trying again (the ``Retry-After`` header)."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "internal_server_error")

    def body(self) -> dict[str, Any]:
        code = self.code or _STATUS_CODES.get(self.status, "internal_error" if self.status >= 500 else "invalid_request")
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": code}}

    def response(self) -> JSONResponse:
        # 4xx are the request's fault (retrying cannot help); 5xx may be transient (a restart, a drain).
        headers = {"x-should-retry": "false"} if self.status < 500 else {}
        if self.retry_after is not None:
            headers["retry-after"] = str(self.retry_after)
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


def invalid(param: str | None, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def from_value_error(exc: ValueError, renames: dict[str, str] | None = None) -> APIError:
    """A 400 for a runtime ``ValueError``, whose message starts with the parameter it names
    (``SamplingParams.validate`` and the engine's checks write them so). ``renames`` maps engine
    names to the request's (``max_new_tokens`` -> ``max_tokens``)."""
    message = str(exc)
    first = message.split(" ", 1)[0].rstrip(":")
    param = first if first in _KNOWN_PARAMS else None
    for engine_name, api_name in (renames or {}).items():
        if param == engine_name:
            param = api_name
            message = api_name + message[len(engine_name):]
    return invalid(param, message)


def _param_of(location: tuple[Any, ...]) -> str | None:
    """``messages[0].content`` from pydantic's ("body", "messages", 0, "content"); union member tags
    (``str``, ``list[int]``) are left out, they are not the request's field names."""
    return param_path([p for p in location
                       if p != "body" and not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS))])


def param_path(parts: Sequence[str | int]) -> str | None:
    """``messages[0].content`` for ("messages", 0, "content")."""
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or None


def _validation_problem(param: str | None, problem: dict[str, Any]) -> APIError:
    """pydantic's complaint in kiln's words: the parameter first, a code for the kind of problem."""
    kind = str(problem.get("type", ""))
    if param is None:
        # The body itself: absent, or not a JSON object.
        missing = kind == "missing"
        message = "the request body is required: a JSON object" if missing else \
            f"the request body must be a JSON object: {problem.get('msg')}"
        return APIError(400, message, code="missing_required_parameter" if missing else "invalid_type")
    if kind == "missing":
        return APIError(400, f"{param}: this parameter is required", param=param, code="missing_required_parameter")
    code = "invalid_type" if kind.endswith(("_type", "_parsing")) or kind in _TYPE_TAGS else "invalid_value"
    return APIError(400, f"{param}: {problem.get('msg')}", param=param, code=code)


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = exc.errors() or [{"loc": (), "msg": "invalid request"}]
        if any(p.get("type") == "json_invalid" for p in problems):
            return APIError(400, "the request body is not valid JSON", code="invalid_json").response()
        # A union reports one error per member; the deepest one says most (content[0].type, not "a string").
        first = max(problems, key=lambda p: len(p.get("loc", ())))
        return _validation_problem(_param_of(first.get("loc", ())), first).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error while serving a request")
        return APIError(500, f"internal error: {type(exc).__name__}").response()

