"""Tool-call formats: how each model family writes calls, as a parser of output text and as the
xgrammar structural tag that makes the model write exactly that.

Names follow SGLang and vLLM (``--tool-call-parser``):

    hermes    <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (Qwen2.5, Hermes; the
              built-in tool template's format)
    llama3    {"name": "f", "parameters": {...}}; several joined by "; "   (Llama 3.1+ JSON calls)
    mistral   [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]
    pythonic  [f(a=1, b="x"), g()]   (Llama 3.2/4 pythonic; argument values as JSON literals)

A parser gives three things. ``parse``: the text outside calls and the calls, read from a whole
output. ``required_format``: a format that is one or more calls and nothing else (for ``required``
and a named ``tool_choice``). ``auto_format``: free text in which a call, from its opening text on,
is constrained (a triggered tag). Arguments are each function's JSON schema in every format, so
they parse and validate by construction.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

from . import formats
from .formats import Format


@dataclass(frozen=True)
class FunctionSpec:
    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: Any  # the decoded arguments (a dict when the call is well formed)


class ToolCallParser:
    name: ClassVar[str]
    # Texts that open the tool-call part of an output: streaming holds text back from one on.
    starts: ClassVar[tuple[str, ...]]
    # Whether the call syntax uses special tokens, which the detokenizer must then keep.
    needs_special_tokens: ClassVar[bool] = False

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        """The text outside calls (as it is, whitespace kept) and the calls; ``ValueError`` when text
        after an opening is not well-formed calls."""
        raise NotImplementedError

    def call_start(self, text: str, start: int = 0) -> int | None:
        """Where the first opening in ``text`` (from ``start`` on) is, or None."""
        found = [i for i in (text.find(s, start) for s in self.starts) if i >= 0]
        return min(found) if found else None

    def complete_until(self, text: str) -> int:
        """How much of ``text`` (from an opening on) holds only finished calls, for streaming them
        before the output ends; 0 when calls are only known once it ends."""
        return 0

    def required_format(self, functions: Sequence[FunctionSpec], parallel: bool) -> Format:
        raise NotImplementedError

    def auto_format(self, functions: Sequence[FunctionSpec], parallel: bool) -> Format:
        raise NotImplementedError


def _call(data: Any, arguments_key: str = "arguments") -> ParsedCall:
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        raise ValueError(f"a tool call must be an object with a string name, got {json.dumps(data)[:200]}")
    arguments = data.get(arguments_key, data.get("arguments", data.get("parameters", {})))
    return ParsedCall(data["name"], arguments)


def _json_objects(text: str, separator: str) -> tuple[list[Any], str]:
    """JSON values at the start of ``text`` joined by ``separator``, and the text after them."""
    decoder, values, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        value, pos = decoder.raw_decode(text, pos)
        values.append(value)
        rest = text[pos:].lstrip()
        if not rest.startswith(separator.strip()):
            return values, text[pos:]
        pos = len(text) - len(rest) + len(separator.strip())


class HermesParser(ToolCallParser):
    name = "hermes"
    starts = ("<tool_call>",)
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        calls, content, pos = [], [], 0
        for match in self._CALL.finditer(text):
            content.append(text[pos:match.start()])
            pos = match.end()
            if not match.group(0).endswith("</tool_call>"):
                # The output ended inside this call (max_tokens): the calls before it still stand.
                try:
                    calls.append(_call(json.loads(match.group(1))))
                except ValueError:
                    pass
                break
            calls.append(_call(json.loads(match.group(1))))
        content.append(text[pos:])
        return "".join(content), calls

    def complete_until(self, text: str) -> int:
        end = text.rfind("</tool_call>")
        return end + len("</tool_call>") if end >= 0 else 0

    def _tags(self, functions: Sequence[FunctionSpec]) -> list[Format]:
        return [formats.tag(f'<tool_call>\n{{"name": {json.dumps(f.name)}, "arguments": ',
                            formats.json_value(f.parameters), "}\n</tool_call>") for f in functions]

    def required_format(self, functions: Sequence[FunctionSpec], parallel: bool) -> Format:
        return formats.separated(self._tags(functions), "\n", stop_after_first=not parallel)

    def auto_format(self, functions: Sequence[FunctionSpec], parallel: bool) -> Format:
        return formats.triggered(["<tool_call>"], self._tags(functions), stop_after_first=not parallel)


class Llama3JsonParser(ToolCallParser):
    name = "llama3"
    starts = ("<|python_tag|>", '{"name"')
    needs_special_tokens = True  # <|python_tag|>
    _OPEN = re.compile(r'(?:<\|python_tag\|>\s*)?(?=\{\s*"name"\s*:)')

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        match = self._OPEN.search(text)
        if match is None:
            return text, []
        values, rest = _json_objects(text[match.end():], "; ")
        return text[:match.start()] + rest, [_call(v, "parameters") for v in values]

    def _tags(self, functions: Sequence[FunctionSpec]) -> list[Format]:
        return [formats.tag(f'{{"name": {json.dumps(f.name)}, "parameters": ', formats.json_value(f.parameters), "}")
                for f in functions]

    def required_format(self, functions: Sequence[FunctionSpec], parallel: bool) -> Format:
        return formats.separated(self._tags(functions), "; ", stop_after_first=not parallel)

    def auto_format(self, functions: Sequence[FunctionSpec], parallel: bool) -> Format:
        return formats.triggered(['{"name": '], self._tags(functions), stop_after_first=not parallel)


class MistralParser(ToolCallParser):
    name = "mistral"
    starts = ("[TOOL_CALLS]",)
    needs_special_tokens = True  # [TOOL_CALLS] is a special token in Mistral vocabularies

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        start = text.find("[TOOL_CALLS]")
        if start < 0:
            return text, []
        after = text[start + len("[TOOL_CALLS]"):].lstrip()
        values, end = json.JSONDecoder().raw_decode(after)
        rest = after[end:]
        if not isinstance(values, list):
            raise ValueError("[TOOL_CALLS] must be followed by a JSON array of calls")
        return text[:start] + rest, [_call(v) for v in values]

    def _calls(self, functions: Sequence[FunctionSpec], parallel: bool) -> Format:
        tags = [formats.tag(f'{{"name": {json.dumps(f.name)}, "arguments": ', formats.json_value(f.parameters), "}")
                for f in functions]
        return formats.separated(tags, ", ", stop_after_first=not parallel)

    def required_format(self, functions: Sequence[FunctionSpec], parallel: bool) -> Format:
        return formats.sequence(formats.const("[TOOL_CALLS]["), self._calls(functions, parallel), formats.const("]"))

    def auto_format(self, functions: Sequence[FunctionSpec], parallel: bool) -> Format:
        return formats.triggered(["[TOOL_CALLS]"], [formats.tag("[TOOL_CALLS][", self._calls(functions, parallel), "]")],
                                 stop_after_first=True)


class PythonicParser(ToolCallParser):
    """Calls as a Python list of calls with keyword arguments. Values are written as JSON (the
    grammar uses each parameter's schema), which Python reads as literals except ``true``,
    ``false`` and ``null``: those names are read as JSON's. In ``auto`` a call list starts at "[",
    so any "[" in free text opens one."""

    name = "pythonic"
    starts = ("[",)
    _NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        start = text.find("[")
        if start < 0:
            return text, []
        for end in [m.start() for m in re.finditer(r"\]", text[start:])]:
            try:
                tree = ast.parse(text[start:start + end + 1].strip(), mode="eval").body
            except SyntaxError:
                continue
            if isinstance(tree, ast.List) and tree.elts and all(isinstance(e, ast.Call) for e in tree.elts):
                calls = [self._call(e) for e in tree.elts]
                return text[:start] + text[start + end + 1:], calls
        return text, []

    def _call(self, node: ast.Call) -> ParsedCall:
        if node.args:
            raise ValueError("pythonic tool calls take keyword arguments only")
        name = ast.unparse(node.func)
        return ParsedCall(name, {k.arg: self._literal(k.value) for k in node.keywords})

    def _literal(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Name) and node.id in self._NAMES:
            return self._NAMES[node.id]
        if isinstance(node, (ast.List, ast.Tuple)):
            return [self._literal(e) for e in node.elts]
        if isinstance(node, ast.Dict):
            return {self._literal(k): self._literal(v) for k, v in zip(node.keys, node.values)}
        return ast.literal_eval(node)

    def _keyword_arguments(self, parameters: dict[str, Any]) -> Format:
        """``a=<json>, b=<json>`` in the schema's property order: required ones always, optional
        ones each maybe."""
        properties: dict[str, Any] = parameters.get("properties") or {}
        required = [k for k in properties if k in set(parameters.get("required") or [])]
        optional = [k for k in properties if k not in required]

        def argument(key: str, lead: str) -> Format:
            return formats.sequence(formats.const(f"{lead}{key}="), formats.json_value(properties[key]))

        if required:
            return formats.sequence(*[argument(k, ", " if i else "") for i, k in enumerate(required)],
                                    *[formats.optional(argument(k, ", ")) for k in optional])
        # No required argument: none at all, or a first optional one and maybe later ones.
        firsts = [formats.sequence(argument(k, ""), *[formats.optional(argument(j, ", ")) for j in optional[i + 1:]])
                  for i, k in enumerate(optional)]
        return formats.optional(formats.any_of(*firsts)) if firsts else formats.const("")

    def _calls(self, functions: Sequence[FunctionSpec], parallel: bool) -> Format:
        tags = [formats.tag(f"{f.name}(", self._keyword_arguments(f.parameters), ")") for f in functions]
        return formats.separated(tags, ", ", stop_after_first=not parallel)

    def required_format(self, functions: Sequence[FunctionSpec], parallel: bool) -> Format:
        return formats.sequence(formats.const("["), self._calls(functions, parallel), formats.const("]"))

    def auto_format(self, functions: Sequence[FunctionSpec], parallel: bool) -> Format:
        return formats.triggered(["["], [formats.tag("[", self._calls(functions, parallel), "]")], stop_after_first=True)


PARSERS: dict[str, type[ToolCallParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser,
                                                                  PythonicParser)}


def parser_for_template(template: str | None) -> str:
    """The parser a chat template's own call syntax implies; hermes (the built-in tool template's) else."""
    text = template or ""
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or "ipython" in text:
        return "llama3"
    return "hermes"


def get_parser(name: str) -> ToolCallParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; expected one of {', '.join(PARSERS)}")
    return PARSERS[name]()
