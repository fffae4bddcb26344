"""``POST /v1/responses``: OpenAI's Responses API for text in and text out, as SGLang and vLLM serve it.

Takes ``input`` (a string, or messages whose content is a string or ``input_text`` parts),
``instructions`` (a system turn before the input), ``max_output_tokens``, ``temperature``,
``top_p`` and ``stream``. Answers a ``response`` object whose ``output`` holds one assistant
message with one ``output_text`` part; streaming sends the Responses events (``response.created``,
``response.output_text.delta``... ``response.completed``), each as ``event: TYPE`` + ``data: JSON``.
Tools, reasoning and stored conversations (``previous_response_id``) are not served: a request
naming them gets a 400.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Literal, Union

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from kiln.runtime.sampling import SamplingParams

from .context import ServerContext
from .errors import APIError, invalid
from .openai_routes import CLIENT_CLOSED, collect_unless_disconnected
from .streaming import EventStream
from .request_stream import RequestStream, Usage

UNSERVED = ("tools", "previous_response_id", "reasoning")


class InputText(BaseModel):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[InputText]]


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # metadata, store, user... change nothing here
    model: str | None = None
    input: Union[str, list[InputMessage]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    stream: bool = False

    def messages(self) -> list[dict[str, str]]:
        for name in UNSERVED:
            if (self.model_extra or {}).get(name):
                raise invalid(name, f"{name}: not supported by this server's Responses API (text in, text out)")
        turns = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return turns + [{"role": "user", "content": self.input}]
        for message in self.input:
            text = message.content if isinstance(message.content, str) else "\n".join(p.text for p in message.content)
            turns.append({"role": "system" if message.role == "developer" else message.role, "content": text})
        return turns


def add_responses_route(app: FastAPI, ctx: ServerContext) -> None:
    manager = ctx.manager

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        lora = ctx.check_model(body.model)
        prompt_ids = await manager.render_chat(body.messages())
        max_new = body.max_output_tokens or manager.default_max_tokens(prompt_ids)
        params = SamplingParams(max_new_tokens=max_new, temperature=body.temperature, top_p=body.top_p)
        manager.check(prompt_ids, params, "input", "max_output_tokens")
        stream = manager.submit([prompt_ids], params, "max_output_tokens", lora=lora)
        shell = _shell(f"resp_{uuid.uuid4().hex}", ctx.model_name, body)
        if body.stream:
            return EventStream(_events(stream, shell), stream)
        acc = await collect_unless_disconnected(request, stream, 1)
        if acc is None:
            return Response(status_code=CLIENT_CLOSED)
        sample = acc.samples[0]
        return JSONResponse(_finished(shell, sample.text, sample.finish_reason, stream.usage))


def _shell(rid: str, model: str, body: ResponsesRequest) -> dict[str, Any]:
    return {"id": rid, "object": "response", "created_at": int(time.time()), "model": model,
            "status": "in_progress", "output": [], "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
            "parallel_tool_calls": False, "tool_choice": "none", "tools": [], "error": None,
            "incomplete_details": None, "usage": None}


def _message(rid: str, text: str, status: str) -> dict[str, Any]:
    content = [] if status == "in_progress" else [{"type": "output_text", "text": text, "annotations": []}]
    return {"type": "message", "id": f"msg_{rid[5:]}", "status": status, "role": "assistant", "content": content}


def _finished(shell: dict[str, Any], text: str, reason: str | None, usage: Usage) -> dict[str, Any]:
    complete = reason != "length"
    return {**shell, "status": "completed" if complete else "incomplete",
            "incomplete_details": None if complete else {"reason": "max_output_tokens"},
            "output": [_message(shell["id"], text, "completed")],
            "usage": {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                      "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                      "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                      "output_tokens_details": {"reasoning_tokens": 0}}}


async def _events(stream: RequestStream, shell: dict[str, Any]) -> AsyncIterator[str]:
    sequence = 0

    def event(kind: str, **data: Any) -> str:
        nonlocal sequence
        sequence += 1
        payload = {"type": kind, "sequence_number": sequence - 1, **data}
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    item_id = f"msg_{shell['id'][5:]}"
    part = {"type": "output_text", "text": "", "annotations": []}
    yield event("response.created", response=shell)
    yield event("response.in_progress", response=shell)
    yield event("response.output_item.added", output_index=0, item=_message(shell["id"], "", "in_progress"))
    yield event("response.content_part.added", item_id=item_id, output_index=0, content_index=0, part=part)
    text, reason = "", None
    try:
        async for out in stream:
            if out.text:
                text += out.text
                yield event("response.output_text.delta", item_id=item_id, output_index=0, content_index=0,
                            delta=out.text, logprobs=[])
            reason = out.finish_reason or reason
    except APIError as exc:
        yield event("error", code=exc.body()["error"]["code"], message=exc.message, param=exc.param)
        return
    yield event("response.output_text.done", item_id=item_id, output_index=0, content_index=0, text=text, logprobs=[])
    yield event("response.content_part.done", item_id=item_id, output_index=0, content_index=0,
                part={**part, "text": text})
    yield event("response.output_item.done", output_index=0, item=_message(shell["id"], text, "completed"))
    yield event("response.completed", response=_finished(shell, text, reason, stream.usage))
