"""The request fields of OpenAI tool calling: ``tools``, ``tool_choice``, ``parallel_tool_calls``.

``ToolFields`` is mixed into the chat request schema. Shapes are checked here (pydantic reports
a malformed tool as a 400 naming ``tools[i]...``); what the shapes cannot say (a parameters object
that is not a JSON schema, duplicate names, a ``tool_choice`` naming no tool) is the registry's.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class ToolFields(BaseModel):
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
