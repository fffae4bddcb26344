"""``kiln router --pd-disaggregation --prefill URL [BOOTSTRAP_PORT] --decode URL``: SGLang's PD router.

Each generation request (``/generate``, ``/v1/completions``, ``/v1/chat/completions``) gets a random
``bootstrap_room`` and the prefill server's ``bootstrap_host``/``bootstrap_port``, and goes to both
servers at once: the prefill server prefills it and hands its KV pages to the decode server, which
waits for them, decodes and answers (server/disaggregation.py). The client gets the decode server's
answer, streamed or whole as it asked. A failed prefill (an error answer, or no answer: the server is
down) ends the request with that error, or 503 naming the prefill server, and the decode request is
cancelled; a decode server that does not answer gives 503 naming it.
"""

from __future__ import annotations

import asyncio
import random
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "server_error" if status >= 500 else
                                   "invalid_request_error", "param": None, "code": status}}, status_code=status)


def build_router_app(prefill_url: str, bootstrap_port: int, decode_url: str) -> FastAPI:
    app = FastAPI()
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
    bootstrap_host = urlsplit(prefill_url).hostname

    async def forward(path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return error(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object")
        body.update(bootstrap_host=bootstrap_host, bootstrap_port=bootstrap_port,
                    bootstrap_room=random.getrandbits(63))
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        decode = asyncio.ensure_future(client.send(client.build_request("POST", decode_url + path, json=body,
                                                                        headers=headers), stream=True))
        try:
            prefill = await client.post(prefill_url + path, json={**body, "stream": False}, headers=headers)
        except httpx.TransportError as exc:
            decode.cancel()
            return error(503, f"the prefill server {prefill_url} is unavailable: {exc!r}")
        if prefill.status_code != 200:
            decode.cancel()
            return Response(prefill.content, prefill.status_code, media_type="application/json")
        try:
            answer = await decode
        except httpx.TransportError as exc:
            return error(503, f"the decode server {decode_url} is unavailable: {exc!r}")
        return StreamingResponse(answer.aiter_raw(), answer.status_code,
                                 media_type=answer.headers.get("content-type"), background=BackgroundTask(answer.aclose))

    def route(path: str):
        async def endpoint(request: Request) -> Response:
            return await forward(path, request)
        return endpoint

    for path in GENERATION_PATHS:
        app.add_api_route(path, route(path), methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        for name, url in (("prefill", prefill_url), ("decode", decode_url)):
            try:
                if (await client.get(url + "/health", timeout=5)).status_code != 200:
                    return error(503, f"the {name} server {url} is not healthy")
            except httpx.TransportError:
                return error(503, f"the {name} server {url} is unavailable")
        return Response(status_code=200)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        """Both servers serve one artifact, so one tokenizer: the decode server's answer (load generators
        calibrate prompt lengths with it)."""
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        answer = await client.post(decode_url + "/tokenize", content=await request.body(), headers=headers)
        return Response(answer.content, answer.status_code, media_type="application/json")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        answer = await client.get(decode_url + "/v1/models", headers=headers)
        return Response(answer.content, answer.status_code, media_type="application/json")

    return app

