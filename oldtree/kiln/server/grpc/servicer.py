"""The gRPC server (``kiln serve --grpc-port``): kiln.proto's ``Kiln`` service over the HTTP server's
tokenizer manager and scheduler, in the same event loop.

Every call but ``Health`` needs the server's API key as ``authorization`` metadata (``Bearer KEY``,
as the HTTP header). Requests go through the HTTP API's request bodies and checks, so errors are
the same; they come back as status codes: 400 ``INVALID_ARGUMENT``, 401 ``UNAUTHENTICATED``, 404
``NOT_FOUND``, 413 and 429 ``RESOURCE_EXHAUSTED`` (gRPC itself answers a message over the size
limit so), 503 ``UNAVAILABLE`` (draining, engine down). A drain waits for gRPC calls as for HTTP ones.
"""

from __future__ import annotations

import contextlib
import hmac
import time
import uuid
from typing import AsyncIterator

import grpc
from pydantic import ValidationError

from ..chat_request import prepare_chat
from ..context import ServerContext
from ..errors import APIError, invalid
from ..protocol import ChatCompletionRequest, CompletionRequest, template_messages
from ..responses import Accumulator
from ..responses import chat_response as chat_body
from . import convert
from . import kiln_pb2 as pb
from . import kiln_pb2_grpc as pb_grpc

_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
          404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
          429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}


def status_code(http_status: int) -> grpc.StatusCode:
    return _CODES.get(http_status, grpc.StatusCode.INTERNAL)


def _validation_message(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ()))
    return f"{where}: {first.get('msg')}" if where else str(first.get("msg"))


class KilnServicer(pb_grpc.KilnServicer):
    def __init__(self, ctx: ServerContext, api_key: str | None) -> None:
        self.ctx = ctx
        self.manager = ctx.manager
        self._key = f"Bearer {api_key}".encode() if api_key else None

    @contextlib.asynccontextmanager
    async def _serving(self, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """Admits a call (key, drain) and turns the HTTP API's errors into status codes."""
        if self._key is not None:
            given = dict(context.invocation_metadata() or ()).get("authorization", "")
            if not hmac.compare_digest(given.encode(), self._key):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                    "missing or wrong API key: send authorization: Bearer KEY metadata")
        if self.ctx.state.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        self.ctx.state.active += 1
        try:
            yield
        except APIError as error:
            await context.abort(status_code(error.status), error.message)
        except ValidationError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _validation_message(error))
        finally:
            self.ctx.state.active -= 1

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        async with self._serving(context):
            body = CompletionRequest.model_validate(convert.completion_body(request))
            lora = self.ctx.check_model(body.model)
            (prompt,) = [await self.manager.encode(p, "text") if isinstance(p, str) else list(p) for p in body.prompts()]
            params = body.to_sampling_params(body.max_tokens)
            self.manager.check(prompt, params, "text", "max_tokens")
            stream = self.manager.submit([prompt], params, lora=lora)
            try:
                async for out in stream:
                    if out.text or out.token_ids or out.finish_reason:
                        done = out.finish_reason is not None
                        yield pb.GenerateResponse(text=out.text, token_ids=out.token_ids,
                                                  finish_reason=out.finish_reason or "",
                                                  usage=convert.usage(stream.usage) if done else None)
            finally:
                stream.close()  # a cancelled call aborts the request

    async def Chat(self, request: pb.ChatRequest, context: grpc.aio.ServicerContext) -> pb.ChatResponse:
        async with self._serving(context):
            body = ChatCompletionRequest.model_validate(convert.chat_body(request))
            lora = self.ctx.check_model(body.model)
            chat = await prepare_chat(self.ctx, body)
            stream = self.manager.submit([chat.prompt_ids], chat.params, body.max_tokens_param, lora=lora)
            acc = Accumulator(1)
            try:
                async for out in stream:
                    acc.add(out)
            finally:
                stream.close()
            response = chat_body(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.ctx.model_name, acc,
                                 stream.usage, False)
            if chat.tools is not None:
                response = chat.tools.rewrite_response(response)
            return convert.chat_response(response, stream.usage)

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        async with self._serving(context):
            self.ctx.check_model(request.model or None)
            kind = request.WhichOneof("input")
            if kind == "text":
                add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
                tokens = await self.manager.encode(request.text, "text", add_special_tokens=add_special)
            elif kind == "chat":
                body = ChatCompletionRequest.model_validate(
                    {"messages": [convert.message_dict(m) for m in request.chat.messages]})
                tokens = await self.manager.render_chat(template_messages(body.messages))
            else:
                raise invalid("input", "give text or chat")
            return pb.TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=self.manager.info.max_seq_len)

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
                         ) -> pb.ListModelsResponse:
        async with self._serving(context):
            info = self.manager.info
            return pb.ListModelsResponse(models=[pb.Model(id=info.name, created=info.created,
                                                          max_model_len=info.max_seq_len)])

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        if self.manager.failure is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the engine is unavailable: {self.manager.failure}")
        return pb.HealthResponse(status="ok")


async def start_grpc_server(ctx: ServerContext, host: str, port: int, api_key: str | None,
                            max_message_bytes: int) -> grpc.aio.Server:
    """A started gRPC server on ``host:port`` (in the running event loop)."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_message_bytes),
                                      ("grpc.so_reuseport", 0)])
    pb_grpc.add_KilnServicer_to_server(KilnServicer(ctx, api_key), server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as error:
        raise OSError(f"cannot listen for gRPC on {host}:{port}: {error}") from None
    if bound == 0:
        raise OSError(f"cannot listen for gRPC on {host}:{port}")
    await server.start()
    return server
