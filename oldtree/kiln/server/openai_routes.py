"""``/v1/chat/completions`` and ``/v1/completions``: OpenAI's request and response shapes over the engine.

Each route checks the model name and ``n``, builds prompt token ids (chat template, or the prompt
text/ids) and ``SamplingParams``, lets the tokenizer manager check them against the model, submits,
and answers with one JSON body or an SSE stream of chunks ending in ``data: [DONE]``.
"""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from .context import ServerContext
from .errors import APIError, invalid
from .chat_request import prepare_chat
from .protocol import ChatCompletionRequest, CompletionRequest
from .responses import (SSE_DONE, Accumulator, ChunkFrames, chat_logprobs, chat_response, completion_logprobs,
                        completion_response, finish_reason, sse)
from .streaming import ClientDisconnected, EventStream, until_disconnect
from .request_stream import RequestStream
from .tools.streaming import tool_chat_events

CLIENT_CLOSED = 499


def add_openai_routes(app: FastAPI, ctx: ServerContext) -> None:
    manager = ctx.manager

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        lora = ctx.check_model(body.model)
        ctx.check_n(body.n)
        chat = await prepare_chat(ctx, body)
        params, tools = chat.params, chat.tools
        stream = manager.submit([chat.prompt_ids], params, body.max_tokens_param, lora=lora, bootstrap=body.bootstrap())
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream and tools is not None:
            return EventStream(tool_chat_events(stream, rid, created, body.model or ctx.model_name, body, tools), stream)
        if body.stream:
            return EventStream(_chat_events(stream, rid, created, body.model or ctx.model_name, body), stream)
        acc = await collect_unless_disconnected(request, stream, params.n)
        if acc is None:
            return Response(status_code=CLIENT_CLOSED)
        response = chat_response(rid, created, body.model or ctx.model_name, acc, stream.usage, body.logprobs)
        return JSONResponse(tools.rewrite_response(response) if tools is not None else response)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        lora = ctx.check_model(body.model)
        ctx.check_n(body.n)
        texts = body.prompts()
        prompts = [await manager.encode(p, "prompt") if isinstance(p, str) else list(p) for p in texts]
        params = body.to_sampling_params(body.generated_tokens)
        for prompt_ids in prompts:
            manager.check(prompt_ids, params, "prompt", "max_tokens")
        stream = manager.submit(prompts, params, lora=lora, bootstrap=body.bootstrap())
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            if body.echo:
                raise invalid("echo", "echo is not supported with stream")
            return EventStream(_completion_events(stream, rid, created, body.model or ctx.model_name, body), stream)
        acc = await collect_unless_disconnected(request, stream, params.n)
        if acc is None:
            return Response(status_code=CLIENT_CLOSED)
        echoes = [manager.echo(text, ids) for text, ids in zip(texts, prompts)] if body.echo else None
        return JSONResponse(completion_response(rid, created, body.model or ctx.model_name, acc, stream.usage,
                                                body.logprobs is not None, echoes, body.max_tokens > 0))



async def _collect(stream: RequestStream, acc: Accumulator) -> Accumulator:
    async for output in stream:
        acc.add(output)
    return acc


async def _chat_events(stream: RequestStream, rid: str, created: int, model: str,
                       body: ChatCompletionRequest) -> AsyncIterator[str]:
    frames = ChunkFrames(rid, "chat.completion.chunk", created, model)
    for index in range(body.n):  # one chunk per choice, as OpenAI streams them
        first = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        yield frames.frame(first)
    try:
        async for out in stream:
            if not (out.text or out.logprobs or out.finish_reason):
                continue  # tokens whose text is held back (an unfinished character, a possible stop string)
            choice = {"index": out.index, "delta": {"content": out.text} if out.text else {},
                      "logprobs": chat_logprobs(out.logprobs) if body.logprobs and out.logprobs else None,
                      "finish_reason": finish_reason(out.finish_reason)}
            if out.finish_reason is not None:
                choice["matched_stop"] = out.matched_stop
            yield frames.frame(choice)
        if body.include_usage:
            yield frames.usage_frame(stream.usage)
    except APIError as exc:
        yield sse(exc.body())
    yield SSE_DONE


async def _completion_events(stream: RequestStream, rid: str, created: int, model: str,
                             body: CompletionRequest) -> AsyncIterator[str]:
    acc = Accumulator(body.n)
    frames = ChunkFrames(rid, "text_completion", created, model)
    try:
        async for out in stream:
            if not (out.text or out.logprobs or out.finish_reason):
                continue
            index = acc.choice_index(out)
            offset = len(acc.samples[index].text) if index in acc.samples else 0
            acc.add(out)
            logprobs = completion_logprobs(out.logprobs, offset) if body.logprobs is not None else None
            choice = {"index": index, "text": out.text, "logprobs": logprobs,
                      "finish_reason": finish_reason(out.finish_reason)}
            if out.finish_reason is not None:
                choice["matched_stop"] = out.matched_stop
            yield frames.frame(choice)
        if body.include_usage:
            yield frames.usage_frame(stream.usage)
    except APIError as exc:
        yield sse(exc.body())
    yield SSE_DONE


async def collect_unless_disconnected(request: Request, stream, n: int) -> Accumulator | None:
    """The whole response, or None when the client left first (the stream is closed either way,
    which aborts whatever still runs)."""
    try:
        return await until_disconnect(request, _collect(stream, Accumulator(n)))
    except ClientDisconnected:
        return None
    finally:
        stream.close()
