"""Streaming a chat completion with tools: text as ``content`` deltas, calls as ``tool_calls`` deltas.

Text streams as it comes until a call may be opening (a suffix that could begin one of the parser's
opening texts is held back). From an opening on, text is held: a call is sent once it is finished
(for formats that close each call, as hermes does) or when the output ends. A call goes out as two
deltas the official client assembles: its ``index``, ``id``, ``type`` and ``function.name`` with
empty ``arguments``, then the arguments. The calls are the same as the non-streamed response's:
the same parser reads the same text, and the same registry validates them.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from ..errors import APIError
from ..responses import SSE_DONE, chat_logprobs, chunk, finish_reason, sse
from ..request_stream import RequestStream
from .request import ToolRequest, tool_call_body

Delta = dict[str, Any]


def _held_back(text: str, starts: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that begins an opening (it may become one)."""
    longest = 0
    for start in starts:
        for size in range(1, min(len(start), len(text) + 1)):
            if text.endswith(start[:size]):
                longest = max(longest, size)
    return longest


class ToolCallStream:
    """One sample's text split into content and call deltas."""

    def __init__(self, tools: ToolRequest) -> None:
        self.tools = tools
        self.text = ""
        self.content_sent = 0  # characters of ``text`` sent as content
        self.call_start: int | None = None  # where the call part of ``text`` begins
        self.calls_seen = 0  # calls read from the finished part of the call region
        self.calls_sent = 0

    def feed(self, delta: str) -> list[Delta]:
        self.text += delta
        if self.tools.choice == "none":
            return self._content(len(self.text))
        if self.call_start is None:
            self.call_start = self.tools.parser.call_start(self.text, self.content_sent)
            if self.call_start is None:
                return self._content(len(self.text) - _held_back(self.text, self.tools.parser.starts))
            deltas = self._content(self.call_start)
        else:
            deltas = []
        region = self.text[self.call_start:]
        finished = self.tools.parser.complete_until(region)
        if finished:
            try:
                _, calls = self.tools.parser.parse(region[:finished])
            except ValueError:
                return deltas  # decided when the output ends
            deltas += self._calls(calls[self.calls_seen:])
            self.calls_seen = len(calls)
        return deltas

    def finish(self) -> list[Delta]:
        if self.call_start is None:
            return self._content(len(self.text))
        region = self.text[self.call_start:]
        try:
            rest, calls = self.tools.parser.parse(region)
        except ValueError:
            rest, calls = region, []
        deltas = self._calls(calls[self.calls_seen:])
        if self.calls_sent == 0:
            deltas += [{"content": region}]  # no call after all: the text was content
        elif rest.strip():
            deltas += [{"content": rest}]
        return deltas

    def _content(self, upto: int) -> list[Delta]:
        piece = self.text[self.content_sent:upto]
        self.content_sent = max(self.content_sent, upto)
        return [{"content": piece}] if piece else []

    def _calls(self, calls: list) -> list[Delta]:
        deltas = []
        for call in self.tools.valid_calls(calls):
            body = tool_call_body(call)
            head = {"index": self.calls_sent, "id": body["id"], "type": "function",
                    "function": {"name": body["function"]["name"], "arguments": ""}}
            deltas += [{"tool_calls": [head]},
                       {"tool_calls": [{"index": self.calls_sent, "function": {"arguments": body["function"]["arguments"]}}]}]
            self.calls_sent += 1
        return deltas


async def tool_chat_events(stream: RequestStream, rid: str, created: int, model: str, body: Any,
                           tools: ToolRequest) -> AsyncIterator[str]:
    """The SSE events of a streamed chat completion with tools."""
    def event(choices: list[dict[str, Any]], usage: Any = None) -> str:
        return sse(chunk(rid, "chat.completion.chunk", created, model, choices, usage))

    splitters = [ToolCallStream(tools) for _ in range(body.n)]
    yield event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                 for i in range(body.n)])
    try:
        async for out in stream:
            splitter = splitters[out.index]
            deltas = splitter.feed(out.text) if out.text else []
            logprobs = chat_logprobs(out.logprobs) if body.logprobs and out.logprobs else None
            if out.finish_reason is not None:
                deltas += splitter.finish()
            for position, delta in enumerate(deltas):
                yield event([{"index": out.index, "delta": delta, "logprobs": logprobs if position == 0 else None,
                              "finish_reason": None}])
            if out.finish_reason is not None:
                reason = finish_reason(out.finish_reason)
                if splitter.calls_sent and reason == "stop":
                    reason = "tool_calls"
                yield event([{"index": out.index, "delta": {}, "logprobs": None, "finish_reason": reason,
                              "matched_stop": out.matched_stop}])
        if body.include_usage:
            yield event([], stream.usage)
    except APIError as exc:
        yield sse(exc.body())
    yield SSE_DONE
