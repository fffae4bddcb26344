"""Tool calling for one chat request: what ``tools``/``tool_choice`` ask, the constraint that makes the
model write valid calls, and the calls read back out of its text.

    tool_choice  constraint                                       output
    none         none (the tools are still shown to the model)   text
    auto         a triggered structural tag: text, and any call   text and/or calls
                 from its opening on follows a tool's schema
    required     one or more calls to any tool, nothing else      calls
    {function}   one or more calls to that tool, nothing else     calls

``parallel_tool_calls: false`` stops the grammar after the first call. Calls come back only when
they validate against the registry; a choice with calls finishes with ``"tool_calls"``.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from kiln.runtime.sampling import SamplingParams
from kiln.runtime.sampling.params import CONSTRAINT_FIELDS

from ..errors import invalid
from . import formats
from .parsers import ParsedCall, ToolCallParser, get_parser
from .protocol import ToolFields
from .registry import FunctionRegistry

log = logging.getLogger("kiln.server")

# The request field a constraint came from, to name it when it clashes with a tool choice.
_CONSTRAINT_PARAMS = {"json_schema": "response_format", "regex": "regex", "ebnf": "ebnf",
                      "structural_tag": "structural_tag"}


@dataclass(frozen=True)
class ToolResult:
    content: str | None
    calls: list[dict[str, Any]]


def tool_call_body(call: ParsedCall) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}


class ToolRequest:
    def __init__(self, body: ToolFields, parser_name: str) -> None:
        self.registry = FunctionRegistry(body.tools or [])
        self.template_tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
        self.parallel = body.parallel_tool_calls
        choice = body.tool_choice if body.tool_choice is not None else "auto"
        self.choice = choice if isinstance(choice, str) else "named"
        self.named = self.registry.named(choice.function.name) if self.choice == "named" else None
        try:
            self.parser: ToolCallParser = get_parser(parser_name)
        except ValueError as error:
            raise invalid("tools", str(error)) from None

    @classmethod
    def of(cls, body: ToolFields, parser_name: str) -> "ToolRequest | None":
        """The request's tool calling, or None when it gives no tools (then ``tool_choice`` may only be none)."""
        if body.tools:
            return cls(body, parser_name)
        if body.tool_choice is not None and body.tool_choice != "none":
            raise invalid("tool_choice", "tool_choice needs tools: give the functions the model may call in "
                                         "`tools`, or leave tool_choice out")
        return None

    def constrain(self, params: SamplingParams) -> None:
        """Adds the tool-call constraint to ``params`` (none for ``tool_choice: none``)."""
        if self.choice == "none":
            return
        taken = next((n for n in CONSTRAINT_FIELDS if getattr(params, n) is not None), None)
        if taken is not None:
            raise invalid("tool_choice", f"tool_choice {self.choice!r} constrains the output to tool calls and "
                                         f"cannot be combined with {_CONSTRAINT_PARAMS[taken]}; use "
                                         "tool_choice \"none\" with it")
        functions = list(self.registry.functions.values())
        if self.choice == "auto":
            format = self.parser.auto_format(functions, self.parallel)
        else:
            format = self.parser.required_format([self.named] if self.named else functions, self.parallel)
        params.structural_tag = formats.structural_tag(format)
        if self.parser.needs_special_tokens:
            params.skip_special_tokens = False  # the call syntax is written in special tokens

    def valid_calls(self, calls: list[ParsedCall]) -> list[ParsedCall]:
        """The calls that may be returned; others are logged and dropped."""
        kept = []
        for call in calls:
            problem = self.registry.problem(call)
            if problem is None:
                kept.append(call)
            else:
                log.warning("dropping a tool call that does not validate: %s", problem)
        return kept

    def result(self, text: str) -> ToolResult:
        """The content and calls of a whole output."""
        start = self.parser.call_start(text) if self.choice != "none" else None
        if start is None:
            return ToolResult(text, [])
        rest, calls = self.read_calls(text[start:])
        if not calls:
            return ToolResult(text, [])
        content = text[:start] + rest
        return ToolResult(content if content.strip() else None, [tool_call_body(c) for c in calls])

    def read_calls(self, region: str) -> tuple[str, list[ParsedCall]]:
        """The valid calls in the call part of an output (from its opening on), and the text after
        them when it is more than whitespace (whitespace between and after calls is layout)."""
        try:
            rest, parsed = self.parser.parse(region)
        except ValueError as error:
            log.warning("output holds a malformed tool call (%s); returning it as text", error)
            return region, []
        return (rest if rest.strip() else ""), self.valid_calls(parsed)

    def rewrite_response(self, response: dict[str, Any]) -> dict[str, Any]:
        """A chat completion body with each choice's calls moved from its text into ``tool_calls``."""
        for choice in response["choices"]:
            message = choice["message"]
            result = self.result(message["content"])
            message["content"] = result.content
            if result.calls:
                message["tool_calls"] = result.calls
                if choice["finish_reason"] == "stop":
                    choice["finish_reason"] = "tool_calls"
        return response
