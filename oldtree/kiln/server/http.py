"""The HTTP application: FastAPI routes behind the ``Gate`` middleware.

Routes: ``/v1/chat/completions`` and ``/v1/completions`` (openai_routes), ``/v1/responses``
(responses_api), ``/generate``,
``/tokenize`` and ``/detokenize`` (native_routes), and here ``/v1/models`` and
``/v1/models/{id}``, ``/health`` (200 while the engine is up; its JSON has the start-up report, see
``kiln.runtime.startup``), ``/health_generate`` (generates one token end to end), ``/metrics``
(Prometheus text; with several API servers, all of theirs summed: see metrics.py), and FastAPI's
``/openapi.json`` and ``/docs``.
"""

from __future__ import annotations

import asyncio
import warnings

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse

from kiln.runtime.sampling import SamplingParams

from . import errors
from .body import BodyLimits, checked_route
from .context import ServerContext
from .errors import APIError
from .gate import ASGIApp, Gate
from .lora_routes import add_lora_routes
from .native_routes import add_native_routes
from .openai_routes import add_openai_routes
from .peers import METRICS
from .responses_api import add_responses_route
from .request_stream import RequestStream

# FastAPI imports pydantic.v1 as it builds the first route (to tell v1 models apart: ~0.1 s); imported
# here instead, with the web stack, which loads while the model does, not after the model is ready.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # as FastAPI imports it (v1 warns on newer Pythons)
    import pydantic.v1  # noqa: F401

# /health_generate fails when one token takes longer than this (the engine is stuck or overloaded).
HEALTH_GENERATE_TIMEOUT_S = 30.0


def build_app(ctx: ServerContext, api_key: str | None, max_body_bytes: int,
              body_limits: BodyLimits = BodyLimits()) -> ASGIApp:
    app = FastAPI(title="kiln", docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    # JSON bodies are parsed and checked off the event loop (see body.py).
    app.router.route_class = checked_route(body_limits)
    errors.install(app)
    add_openai_routes(app, ctx)
    add_native_routes(app, ctx)
    add_responses_route(app, ctx)
    add_lora_routes(app, ctx.manager, ctx.adapters, ctx.model_name, ctx.peers)
    ctx.peers.answer(METRICS, ctx.metrics.snapshot)
    manager = ctx.manager

    @app.get("/health")
    async def health() -> JSONResponse:
        if manager.failure is not None:
            return APIError(503, f"the engine is unavailable: {manager.failure}").response()
        startup = ctx.metrics.startup
        return JSONResponse({"status": "ok", **({"startup": startup.to_json()} if startup is not None else {})})

    @app.get("/health_generate")
    async def health_generate() -> JSONResponse:
        tokenizer = manager.tokenizer
        prompt = [tokenizer.bos_token_id] if tokenizer is not None and tokenizer.bos_token_id is not None else [0]
        stream = manager.submit([prompt], SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
        try:
            tokens = await asyncio.wait_for(_count_tokens(stream), HEALTH_GENERATE_TIMEOUT_S)
        except (APIError, asyncio.TimeoutError) as exc:
            return APIError(503, f"generation failed: {exc or 'timed out'}").response()
        finally:
            stream.close()
        return JSONResponse({"status": "ok", "tokens": tokens})

    def model_card() -> dict:
        return {"id": ctx.model_name, "object": "model", "created": manager.info.created, "owned_by": "kiln",
                "max_model_len": manager.info.max_seq_len}

    def adapter_card(name: str) -> dict:  # vLLM's: the adapter's directory as root, the base as parent
        return {**model_card(), "id": name, "root": ctx.adapters.paths[name], "parent": ctx.model_name}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(), *(adapter_card(name) for name in ctx.adapters.paths)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        lora = ctx.check_model(model_id)
        return model_card() if lora is None else adapter_card(lora)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        others = await ctx.peers.ask_all(METRICS)
        return PlainTextResponse(ctx.metrics.render(others), media_type="text/plain; version=0.0.4; charset=utf-8")

    endpoints = frozenset(route.path for route in app.routes if hasattr(route, "path"))
    return Gate(app, state=ctx.state, metrics=ctx.metrics, endpoints=endpoints, api_key=api_key,
                max_body_bytes=max_body_bytes)


async def _count_tokens(stream: RequestStream) -> int:
    return sum([len(output.token_ids) async for output in stream])
