"""OpenAI tool calling: request fields (``protocol``), the function registry (``registry``), call
formats as parsers and structural tags (``parsers``, ``formats``), one request's tool handling
(``request``) and its streaming (``streaming``)."""

from __future__ import annotations

from kiln.runtime.text.tokenizer import Tokenizer

from .parsers import PARSERS, get_parser, parser_for_template


def resolve_parser(configured: str | None, tokenizer: Tokenizer | None) -> str:
    """``--tool-call-parser`` when given (checked), else the one the model's tool template implies."""
    if configured is not None:
        return get_parser(configured).name
    return parser_for_template(tokenizer.tool_chat_template if tokenizer is not None else None)


__all__ = ["PARSERS", "resolve_parser"]
