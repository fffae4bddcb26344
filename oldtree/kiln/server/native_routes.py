"""kiln's own endpoints: ``/generate`` (SamplingParams as they are), ``/tokenize`` and ``/detokenize``.

``/generate`` takes ``{"text" | "input_ids", "sampling_params": {...}, "stream": bool}`` and
answers, per sample, ``{"text", "output_ids", "meta_info": {id, finish_reason, matched_stop,
prompt_tokens, completion_tokens, cached_tokens}}`` (``logprobs`` too when asked): one object for n = 1, a list
otherwise. Streaming sends one SSE event per delta, ``{"index", "text", "output_ids",
"finish_reason"}`` (text and ids are the new part; ``meta_info`` on the last of each sample), then
``data: [DONE]``. ``/tokenize`` and ``/detokenize`` follow vLLM's shapes.
"""

from __future__ import annotations

import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from .context import ServerContext
from .errors import APIError, invalid
from .openai_routes import CLIENT_CLOSED
from .protocol import DetokenizeRequest, GenerateRequest, TokenizeRequest, template_messages
from .responses import SSE_DONE, Accumulator, Sample, spec_usage, sse
from .streaming import ClientDisconnected, EventStream, until_disconnect
from .request_stream import RequestStream, TokenLogprob, Usage


def add_native_routes(app: FastAPI, ctx: ServerContext) -> None:
    manager = ctx.manager

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        if (body.text is None) == (body.input_ids is None):
            raise invalid("text", "give exactly one of text and input_ids")
        param = "text" if body.text is not None else "input_ids"
        prompt_ids = await manager.encode(body.text, "text") if body.text is not None else list(body.input_ids)
        params = body.to_sampling_params()
        ctx.check_n(params.n)
        manager.check(prompt_ids, params, param, "max_new_tokens")
        stream = manager.submit([prompt_ids], params, "max_new_tokens", bootstrap=body.bootstrap())
        rid = uuid.uuid4().hex
        if body.stream:
            return EventStream(_generate_events(stream, rid), stream)
        acc = Accumulator(params.n)
        try:
            await until_disconnect(request, _fill(stream, acc))
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED)
        finally:
            stream.close()
        results = [_result(rid, sample, stream.usage, params.logprobs or params.top_logprobs > 0)
                   for _, sample in acc.ordered()]
        return JSONResponse(results[0] if len(results) == 1 else results)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise invalid("prompt", "give exactly one of prompt and messages")
        if body.messages is not None:
            tokens = await manager.render_chat(template_messages(body.messages))
        else:
            tokens = await manager.encode(body.prompt, "prompt", add_special_tokens=body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": manager.info.max_seq_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        ctx.check_model(body.model)
        if manager.tokenizer is None:
            raise invalid("tokens", "tokens: this model has no tokenizer")
        bad = next((t for t in body.tokens if not 0 <= t < manager.tokenizer.vocab_size), None)
        if bad is not None:
            raise invalid("tokens", f"tokens: token id {bad} is outside the vocabulary")
        return {"prompt": manager.tokenizer.decode(body.tokens)}



async def _fill(stream: RequestStream, acc: Accumulator) -> None:
    async for output in stream:
        acc.add(output)


def _logprobs(entries: list[TokenLogprob]) -> list[dict[str, Any]]:
    return [{"token_id": e.token_id, "logprob": e.logprob, "top_logprobs": [[i, lp] for i, _, lp in e.top]}
            for e in entries]


def _result(rid: str, sample: Sample, usage: Usage, with_logprobs: bool) -> dict[str, Any]:
    result: dict[str, Any] = {"text": sample.text, "output_ids": sample.token_ids,
                              "meta_info": _meta(rid, sample.finish_reason, sample.matched_stop, len(sample.token_ids),
                                                 usage)}
    if with_logprobs:
        result["logprobs"] = _logprobs(sample.logprobs)
    return result


def _meta(rid: str, reason: str | None, matched_stop: int | str | None, completion_tokens: int,
          usage: Usage) -> dict[str, Any]:
    return {"id": rid, "finish_reason": reason, "matched_stop": matched_stop, "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": completion_tokens, "cached_tokens": usage.cached_tokens, **spec_usage(usage)}


async def _generate_events(stream: RequestStream, rid: str) -> AsyncIterator[str]:
    produced: dict[int, int] = {}
    try:
        async for out in stream:
            produced[out.index] = produced.get(out.index, 0) + len(out.token_ids)
            event: dict[str, Any] = {"index": out.index, "text": out.text, "output_ids": out.token_ids,
                                     "finish_reason": out.finish_reason}
            if out.logprobs:
                event["logprobs"] = _logprobs(out.logprobs)
            if out.finish_reason is not None:
                event["meta_info"] = _meta(rid, out.finish_reason, out.matched_stop, produced[out.index], stream.usage)
            yield sse(event)
    except APIError as exc:
        yield sse(exc.body())
    yield SSE_DONE
