"""Between kiln.proto messages and the HTTP API's request bodies and results.

gRPC requests become the same pydantic bodies the HTTP routes take (``CompletionRequest`` for
``Generate``, ``ChatCompletionRequest`` for ``Chat``), so both APIs check fields alike; results go
back as proto messages.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import invalid
from ..request_stream import Usage
from . import kiln_pb2 as pb

# SamplingParams fields that are proto3 ``optional`` (unset: the HTTP default applies).
_OPTIONAL_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                      "frequency_penalty", "presence_penalty", "seed")


def sampling_fields(sampling: pb.SamplingParams) -> dict[str, Any]:
    fields: dict[str, Any] = {name: getattr(sampling, name) for name in _OPTIONAL_SAMPLING if sampling.HasField(name)}
    fields.update(stop=list(sampling.stop), stop_token_ids=list(sampling.stop_token_ids),
                  ignore_eos=sampling.ignore_eos)
    if sampling.json_schema:
        try:
            schema = json.loads(sampling.json_schema)
        except json.JSONDecodeError as error:
            raise invalid("sampling.json_schema", f"sampling.json_schema is not valid JSON: {error}") from None
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    if sampling.regex:
        fields["regex"] = sampling.regex
    return fields


def completion_body(request: pb.GenerateRequest) -> dict[str, Any]:
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise invalid("prompt", "give the prompt as text or input_ids")
    prompt = request.text if kind == "text" else list(request.input_ids.ids)
    return {"model": request.model or None, "prompt": prompt, **sampling_fields(request.sampling)}


def message_dict(message: pb.ChatMessage) -> dict[str, Any]:
    data: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.name:
        data["name"] = message.name
    if message.tool_call_id:
        data["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        data["tool_calls"] = [{"id": c.id, "type": c.type or "function",
                               "function": {"name": c.function.name, "arguments": c.function.arguments}}
                              for c in message.tool_calls]
        data["content"] = message.content or None
    return data


def _tool_dict(index: int, tool: pb.Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters:
        try:
            function["parameters"] = json.loads(tool.parameters)
        except json.JSONDecodeError as error:
            raise invalid(f"tools[{index}].parameters", f"tools[{index}].parameters is not valid JSON: {error}") from None
    return {"type": "function", "function": function}


def chat_body(request: pb.ChatRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"model": request.model or None, "messages": [message_dict(m) for m in request.messages],
                            **sampling_fields(request.sampling)}
    if request.tools:
        body["tools"] = [_tool_dict(i, t) for i, t in enumerate(request.tools)]
    choice = request.WhichOneof("tool_choice")
    if choice == "mode":
        body["tool_choice"] = request.mode
    elif choice == "function":
        body["tool_choice"] = {"type": "function", "function": {"name": request.function}}
    if request.HasField("parallel_tool_calls"):
        body["parallel_tool_calls"] = request.parallel_tool_calls
    return body


def usage(value: Usage) -> pb.Usage:
    return pb.Usage(prompt_tokens=value.prompt_tokens, completion_tokens=value.completion_tokens,
                    cached_tokens=value.cached_tokens)


def chat_response(body: dict[str, Any], value: Usage) -> pb.ChatResponse:
    """The proto of a chat completion body (one choice)."""
    choice = body["choices"][0]
    message = choice["message"]
    calls = [pb.ToolCall(id=c["id"], type=c["type"], function=pb.FunctionCall(**c["function"]))
             for c in message.get("tool_calls") or []]
    return pb.ChatResponse(id=body["id"], content=message["content"] or "", tool_calls=calls,
                           finish_reason=choice["finish_reason"] or "", usage=usage(value))
