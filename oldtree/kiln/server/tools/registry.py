"""The function registry of one request: its tools, checked once, and every call checked against them.

A tool definition is refused (400 naming ``tools[i]``) when its name is not what OpenAI allows, a
name repeats, or its ``parameters`` is not a JSON schema of an object. A call the model wrote is
returned only when it names a registered function and its arguments validate against that
function's schema (``problem`` says why not otherwise); the constraint makes that the rule, the
check makes it a guarantee.
"""

from __future__ import annotations

import re
from typing import Any

import jsonschema

from ..errors import invalid
from .parsers import FunctionSpec, ParsedCall
from .protocol import ToolDefinition

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class FunctionRegistry:
    def __init__(self, tools: list[ToolDefinition]) -> None:
        self.functions: dict[str, FunctionSpec] = {}
        self._validators: dict[str, jsonschema.protocols.Validator] = {}
        for index, tool in enumerate(tools):
            self._register(f"tools[{index}].function", tool)

    def _register(self, where: str, tool: ToolDefinition) -> None:
        name = tool.function.name
        if not NAME.match(name):
            raise invalid(f"{where}.name", f"{where}.name: {name!r} is not a valid function name (1 to 64 "
                                           "letters, digits, underscores and dashes)")
        if name in self.functions:
            raise invalid(f"{where}.name", f"{where}.name: function {name!r} is defined twice")
        parameters = tool.function.parameters if tool.function.parameters is not None else EMPTY_PARAMETERS
        validator_class = jsonschema.validators.validator_for(parameters, default=jsonschema.Draft202012Validator)
        try:
            validator_class.check_schema(parameters)
        except jsonschema.SchemaError as error:
            path = "".join(f"[{p!r}]" for p in error.absolute_path)
            raise invalid(f"{where}.parameters", f"{where}.parameters{path} of {name!r} is not a valid JSON "
                                                 f"schema: {error.message}") from None
        if parameters.get("type", "object") != "object":
            raise invalid(f"{where}.parameters", f"{where}.parameters of {name!r} must describe an object "
                                                 f"(type \"object\"), got type {parameters.get('type')!r}")
        self.functions[name] = FunctionSpec(name, parameters)
        self._validators[name] = validator_class(parameters)

    def named(self, name: str) -> FunctionSpec:
        if name not in self.functions:
            raise invalid("tool_choice", f"tool_choice names function {name!r}, which is not among the tools "
                                         f"({', '.join(self.functions)})")
        return self.functions[name]

    def problem(self, call: ParsedCall) -> str | None:
        """Why ``call`` cannot be returned, or None when it names a known function with valid arguments."""
        validator = self._validators.get(call.name)
        if validator is None:
            return f"unknown function {call.name!r}"
        error = jsonschema.exceptions.best_match(validator.iter_errors(call.arguments))
        return None if error is None else f"arguments of {call.name!r}: {error.message}"
