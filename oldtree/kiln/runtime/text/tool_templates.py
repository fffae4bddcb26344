"""A built-in tool-capable chat template, for models whose own template has no tools section.

A request that gives ``tools``, or whose history holds assistant ``tool_calls`` or ``role: "tool"``
results, needs a template that renders them. Many small models' templates ignore ``tools`` (SmolLM2's
does): rendering with them would drop the tools silently. ``mentions_tools`` reads the template's
Jinja AST for a ``tools`` variable; when it has none, ``builtin_tool_template`` offers the Hermes
format (as Qwen2.5 writes it) for ChatML vocabularies: the tools as JSON inside ``<tools>`` in the
system turn, calls as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` in the assistant
turn, results as ``<tool_response>`` blocks in a user turn.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Collection, Mapping, Sequence


HERMES_TOOL_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '"
    " 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'"
    " '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- set function = call['function'] if call['function'] is defined else call %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + function['name'] + '\", \"arguments\": ' }}"
    "{%- if function['arguments'] is string %}{{- function['arguments'] }}"
    "{%- else %}{{- function['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@lru_cache(maxsize=16)
def mentions_tools(template: str) -> bool:
    """Whether the template reads a ``tools`` variable (a template that does not would drop them)."""
    import jinja2  # only when a conversation has tools: see Tokenizer.apply_chat_template
    from jinja2 import meta

    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:
        return False  # rendering reports the syntax error itself


def builtin_tool_template(vocabulary: Collection[str]) -> str | None:
    """The built-in tool template that fits the vocabulary's chat markers, or None."""
    if "<|im_start|>" in vocabulary and "<|im_end|>" in vocabulary:
        return HERMES_TOOL_TEMPLATE
    return None


def uses_tools(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> bool:
    """Whether rendering this conversation needs a tool-capable template."""
    return bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages
                              if isinstance(m, Mapping))
