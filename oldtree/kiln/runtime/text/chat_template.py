"""Chat templates: validating chat messages and rendering them to a prompt string with Jinja.

Templates come from the model's tokenizer files and messages come from requests, so both are
untrusted: rendering happens in Jinja's ``ImmutableSandboxedEnvironment`` (no attribute access to
Python internals, no mutation of the values passed in). The environment mirrors what Hugging Face
templates are written against: ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension,
``{% generation %}`` blocks (rendered as their body), a ``tojson`` filter that keeps non-ASCII text
as is, and the ``raise_exception`` and ``strftime_now`` globals.

For tokenizers that ship no template, ``builtin_template`` picks one of a few well-known formats
(ChatML, Llama 3, Llama 2, Mistral) from the model type and the special tokens in the vocabulary.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Collection, Mapping, Sequence

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "user", "assistant", "tool")

CHATML_TEMPLATE = (
    "{% if tools %}{{ raise_exception('the built-in ChatML template does not support tools') }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA3_TEMPLATE = (
    "{% if tools %}{{ raise_exception('the built-in Llama 3 template does not support tools') }}{% endif %}"
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Llama 2 and Mistral share the [INST] turn format. Llama 2 opens every turn with BOS and wraps the
# system prompt in <<SYS>> inside the first user turn; Mistral opens only the conversation with BOS
# and prepends the system prompt to the first user turn's text.
_INST_TEMPLATE = (
    "{% if tools %}{{ raise_exception('the built-in [INST] template does not support tools') }}{% endif %}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set turns = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
    "{% if not llama2 %}{{ bos_token }}{% endif %}"
    "{% for message in turns %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant/user/... after an optional system message') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}"
    "{% set text = message['content'] %}"
    "{% if loop.first and system and llama2 %}{% set text = '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + text %}"
    "{% elif loop.first and system %}{% set text = system + '\\n\\n' + text %}{% endif %}"
    "{% if llama2 %}{{ bos_token }}{% endif %}"
    "{{ '[INST] ' + text | trim + ' [/INST]' }}"
    "{% elif llama2 %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}"
    "{% else %}{{ ' ' + message['content'] | trim + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
)
LLAMA2_TEMPLATE = "{% set llama2 = true %}" + _INST_TEMPLATE
MISTRAL_TEMPLATE = "{% set llama2 = false %}" + _INST_TEMPLATE


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks in HF;
    for rendering a prompt it is just its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(value: Any, indent: int | None = None, separators: tuple[str, str] | None = None,
            sort_keys: bool = False, ensure_ascii: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; prompts need the JSON text itself.
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Checked copies of ``messages``: each a mapping with a known role and text content.

    Content given as a list of ``{"type": "text", "text": ...}`` parts is joined with newlines. An
    assistant message that carries ``tool_calls`` may have no content; it gets an empty string so
    that templates concatenating content still render. Other keys pass through for the template.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"message {index} is not an object")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"message {index} has role {role!r}; expected one of {', '.join(ROLES)}")
        copy = dict(message)
        copy["content"] = _content_text(index, role, message)
        checked.append(copy)
    return checked


def _content_text(index: int, role: str, message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if content is None and role == "assistant" and message.get("tool_calls"):
        return ""
    if isinstance(content, (list, tuple)):
        texts = []
        for part_index, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(f"message {index}: content part {part_index} ({kind!r}) is not a text part")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(f"message {index} has content of type {type(content).__name__}; expected a string "
                     "or a list of text parts")


def render_chat_template(template: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                         tools: Sequence[Mapping[str, Any]] | None = None, bos_token: str | None = None,
                         eos_token: str | None = None,
                         extra_context: Mapping[str, Any] | None = None) -> str:
    """The prompt text for ``messages``. Raises ``ValueError`` for invalid messages, for a template
    that does not compile, and for anything the template raises while rendering.

    ``extra_context`` adds variables some templates read (``enable_thinking``, ``documents``...);
    it cannot replace the ones named here.
    """
    checked = validate_messages(messages)
    if tools is not None and (not isinstance(tools, (list, tuple)) or not all(isinstance(t, Mapping) for t in tools)):
        raise ValueError("tools must be a list of JSON objects")
    context = dict(extra_context or {})
    context.update(messages=checked, tools=list(tools) if tools else None, add_generation_prompt=add_generation_prompt,
                   bos_token=bos_token or "", eos_token=eos_token or "")
    try:
        return _compile(template).render(**context)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"chat template does not compile: {error.message} (line {error.lineno})") from None
    except jinja2.TemplateError as error:
        raise ValueError(f"chat template rejected the messages: {error.message or error}") from None
    except (TypeError, KeyError, IndexError, AttributeError, ValueError, ZeroDivisionError) as error:
        # Templates index and concatenate request data freely; a shape they did not expect
        # (a missing key, None + str) surfaces here and is the request's fault, not the server's.
        raise ValueError(f"chat template failed on the messages: {type(error).__name__}: {error}") from None


def builtin_template(model_type: str | None, vocabulary: Collection[str], bos_token: str | None) -> str | None:
    """A known chat format for a tokenizer that ships no template, or None when none fits.

    The format's marker tokens in the vocabulary decide first (they are what the model was trained
    on); the model type then tells Mistral from Llama 2, which share the ``<s>`` BOS token and
    spell ``[INST]`` as ordinary text in their first versions.
    """
    if "<|im_start|>" in vocabulary and "<|im_end|>" in vocabulary:
        return CHATML_TEMPLATE
    if "<|start_header_id|>" in vocabulary and "<|eot_id|>" in vocabulary:
        return LLAMA3_TEMPLATE
    if model_type in ("mistral", "mixtral") or "[INST]" in vocabulary:
        return MISTRAL_TEMPLATE
    if model_type == "llama" and bos_token == "<s>":
        return LLAMA2_TEMPLATE
    return None
