"""xgrammar structural-tag formats as plain dicts: the pieces tool-call constraints are built from.

Each function returns one format object of xgrammar's structural-tag JSON (``const_string``,
``json_schema``, ``tag``, ``sequence``, ``or``, ``optional``, ``tags_with_separator``,
``triggered_tags``); ``structural_tag`` wraps the top one. Parsers (``parsers``) put them together
in their model's call syntax.
"""

from __future__ import annotations

from typing import Any

Format = dict[str, Any]

# Whitespace runs inside JSON arguments are capped: free whitespace lets small models loop on
# newlines instead of closing the object (the grammar compiler's json_schema default is compact too).
MAX_WHITESPACE = 1


def const(value: str) -> Format:
    return {"type": "const_string", "value": value}


def json_value(schema: dict[str, Any] | bool) -> Format:
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}


def tag(begin: str, content: Format, end: str) -> Format:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def sequence(*elements: Format) -> Format:
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": list(elements)}


def any_of(*elements: Format) -> Format:
    return elements[0] if len(elements) == 1 else {"type": "or", "elements": list(elements)}


def optional(content: Format) -> Format:
    return {"type": "optional", "content": content}


def separated(tags: list[Format], separator: str, stop_after_first: bool) -> Format:
    """One or more of ``tags`` (one only when ``stop_after_first``) with ``separator`` between them."""
    return {"type": "tags_with_separator", "tags": tags, "separator": separator, "at_least_one": True,
            "stop_after_first": stop_after_first}


def triggered(triggers: list[str], tags: list[Format], stop_after_first: bool) -> Format:
    """Free text until a trigger, then one of ``tags`` (whose begin starts with it), then free text again."""
    return {"type": "triggered_tags", "triggers": triggers, "tags": tags, "at_least_one": False,
            "stop_after_first": stop_after_first}


def structural_tag(format: Format) -> dict[str, Any]:
    return {"type": "structural_tag", "format": format}
