"""The tokenizer: text <-> token ids over a Hugging Face-layout tokenizer directory.

A directory holds ``tokenizer.json`` (loaded with the ``tokenizers`` library; transformers is not
imported here, it is slow to import), and optionally ``tokenizer_config.json`` (special tokens,
``add_bos_token``/``add_eos_token``, ``clean_up_tokenization_spaces``, ``chat_template``),
``chat_template.jinja`` or ``chat_template.json`` (templates saved apart, which take priority as
they do in transformers), ``special_tokens_map.json`` (older special-token layout),
``generation_config.json`` (end-of-sequence ids, one or a list) and ``config.json`` (the model
type, used to pick a built-in chat template when none ships).

Text is untrusted: ``encode`` refuses text that is not valid Unicode and, unless asked otherwise,
tokenizes special-token strings in it as plain text; ``encode_chat`` makes the chat template's
markup the only special tokens of a conversation (see ``user_text``).
"""

from __future__ import annotations

import json
import os
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping, Sequence

import tokenizers
from tokenizers import processors

from .token_bytes import TokenBytes, is_byte_level
from .user_text import SpecialTokenMask, require_unicode
from .tool_templates import builtin_tool_template, mentions_tools, uses_tools

_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def _read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, None when the file is absent; a clear error when it is broken."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read {path}: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as configs write it: a string, or a serialized AddedToken with ``content``."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    """Token ids as configs write them: one int, a list of ints, or nothing."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_file = _read_json(directory / "chat_template.json")
    template = (json_file or {}).get("chat_template", config.get("chat_template"))
    if isinstance(template, list):
        # Several named templates: the one named "default" is what a plain chat request uses.
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class Tokenizer:
    """Encode and decode text, and render chat prompts, for one model."""

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token: str | None = None, eos_token: str | None = None,
                 pad_token: str | None = None, extra_eos_token_ids: Sequence[int] = (),
                 chat_template: str | None = None, clean_up_tokenization_spaces: bool = False) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.bos_token_id = self.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = self.token_to_id(eos_token) if eos_token else None
        self.pad_token_id = self.token_to_id(pad_token) if pad_token else None
        eos_ids = set(extra_eos_token_ids)
        if self.eos_token_id is not None:
            eos_ids.add(self.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        vocab = backend.get_vocab(with_added_tokens=True)
        # One past the largest id, so that every id decode accepts is below it.
        self.vocab_size: int = max(vocab.values()) + 1 if vocab else 0
        added = backend.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(i for i, token in added.items() if token.special)
        self.special_tokens: frozenset[str] = frozenset(added[i].content for i in self.special_token_ids)

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str], model_type: str | None = None) -> "Tokenizer":
        """Load the tokenizer in an HF-layout directory. ``model_type`` overrides the one read from
        ``config.json`` when choosing a built-in chat template."""
        directory = Path(path)
        if not directory.is_dir():
            raise FileNotFoundError(f"tokenizer directory {directory} does not exist")
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {directory} (kiln reads tokenizers in the "
                                    "Hugging Face tokenizers format)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # the Rust loader raises a bare Exception for any malformed file
            raise ValueError(f"cannot load {tokenizer_file}: {error}") from None
        config = _read_json(directory / "tokenizer_config.json") or {}
        special_map = _read_json(directory / "special_tokens_map.json") or {}
        generation = _read_json(directory / "generation_config.json") or {}
        model_config = _read_json(directory / "config.json") or {}

        def special(name: str) -> str | None:
            return _token_text(config.get(name)) or _token_text(special_map.get(name))

        bos, eos = special("bos_token"), special("eos_token")
        if bos is None:
            bos = next((backend.id_to_token(i) for i in _ids(generation.get("bos_token_id"))), None)
        generation_eos = _ids(generation.get("eos_token_id")) or _ids(model_config.get("eos_token_id"))
        if eos is None and generation_eos:
            eos = backend.id_to_token(generation_eos[0])
        if "add_bos_token" in config or "add_eos_token" in config:
            backend.post_processor = _bos_eos_processor(backend, bos if config.get("add_bos_token") else None,
                                                        eos if config.get("add_eos_token") else None)
        template = _chat_template(directory, config)
        tokenizer = cls(backend, bos_token=bos, eos_token=eos, pad_token=special("pad_token"),
                        extra_eos_token_ids=generation_eos, chat_template=template,
                        clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)))
        if template is None:
            from .chat_template import builtin_template  # (jinja2 with it: see apply_chat_template)

            tokenizer.chat_template = builtin_template(model_type or model_config.get("model_type"),
                                                       set(backend.get_vocab(with_added_tokens=True)), bos)
        return tokenizer

    def encode(self, text: str, add_special_tokens: bool = True, parse_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. ``add_special_tokens`` adds what the tokenizer's post-processor adds
        (BOS for Llama-style tokenizers). Special-token strings in ``text`` (``<|im_start|>``) are
        tokenized as text unless ``parse_special_tokens``: only trusted text may hold control
        tokens. Raises ``ValueError`` for text that is not valid Unicode."""
        require_unicode(text, "text")
        backend = self.backend if parse_special_tokens else self._text_backend
        return _encode(backend, text, add_special_tokens)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Token ids of a conversation: the template's markup becomes special tokens, whatever the
        messages, tools and template variables say stays text (a message cannot forge a turn)."""
        mask = SpecialTokenMask(self.special_tokens)
        masked = mask.mask([list(messages), tools, template_kwargs])
        text = self.apply_chat_template(masked[0], add_generation_prompt, masked[1], masked[2])
        require_unicode(text, "messages")
        if not mask.replaced:
            # The common case: the text is exactly what transformers renders and tokenizes.
            return _encode(self.backend, text, False)
        ids: list[int] = []
        for piece, special in mask.split(text):
            if special:
                ids.append(self.token_to_id(piece))
            else:
                ids += _encode(self._text_backend, mask.unmask(piece), False)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces:
            for before, after in _CLEANUPS:
                text = text.replace(before, after)
        return text

    def decode_raw(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The decoder's text without the ``clean_up_tokenization_spaces`` rewrite, which depends on
        what follows and so cannot be streamed; the incremental detokenizer uses this."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def _text_backend(self) -> tokenizers.Tokenizer:
        """The same tokenizer with special tokens matched as text, for what users write: a second parse
        of tokenizer.json (~half of ``from_dir``'s time), made on first use, since the scheduler and
        the detokenizer never encode user text (HTTP processes make it as they start:
        ``prepare_for_requests``)."""
        text_backend = tokenizers.Tokenizer.from_str(self.backend.to_str())
        text_backend.encode_special_tokens = True
        return text_backend

    def prepare_for_requests(self) -> "Tokenizer":
        """Makes now what serving requests needs and the scheduler and detokenizer never do, so that
        neither the first request nor a server's last start-up step waits for it: the backend that
        encodes user text and the tool template (whose check parses the chat template: jinja2's import
        and a parse, ~0.1-0.2 s, which the server's tool-call parser asks for as it starts listening)."""
        self._text_backend  # noqa: B018 (cached properties, made here)
        self.tool_chat_template  # noqa: B018
        return self

    @cached_property
    def token_bytes(self) -> TokenBytes:
        """Each token's raw bytes (``token_bytes.TokenBytes``), cached for every user of this tokenizer."""
        return TokenBytes(self)

    @cached_property
    def decodes_bytes(self) -> bool:
        """Whether decoding ids is concatenating their ``token_bytes`` and reading them as UTF-8 (invalid
        bytes as U+FFFD): a byte-level decoder (GPT-2, Llama 3, SmolLM2, Qwen) whose added tokens decode
        as their bytes say (checked here, so that a tokenizers release that decodes them apart from
        the decoder turns the byte-level detokenizer off rather than changing its text)."""
        if not is_byte_level(self.backend.decoder):
            return False
        added = self.backend.get_added_tokens_decoder()
        return all(self.token_bytes.bytes_of(i).decode("utf-8", "replace") ==
                   self.backend.decode([i], skip_special_tokens=False) for i in added)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self.backend.id_to_token(i) for i in ids]

    @cached_property
    def tool_chat_template(self) -> str | None:
        """The template for conversations with tools: the model's own when it renders them, else a
        built-in one that fits the vocabulary (``tool_templates``), else None."""
        if self.chat_template is not None and mentions_tools(self.chat_template):
            return self.chat_template
        return builtin_tool_template(self.backend.get_vocab(with_added_tokens=True))

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The prompt text for a conversation (see ``chat_template.render_chat_template``). To tokenize
        a conversation use ``encode_chat``, which keeps the messages' text from becoming markup."""
        template = self.tool_chat_template if uses_tools(messages, tools) else self.chat_template
        if template is None:
            if uses_tools(messages, tools):
                raise ValueError("this model's chat template has no tools section and no built-in tool template "
                                 "fits its tokens (the built-in one is ChatML's, with <|im_start|> and <|im_end|>)")
            raise ValueError("this tokenizer has no chat template and none of the built-in ones fits it")
        # Imported here, not with this module: the scheduler process loads a tokenizer but renders no
        # template, and jinja2's import (~0.13 s) would lengthen every server's start-up.
        from .chat_template import render_chat_template

        return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                    tools=tools, bos_token=self.bos_token, eos_token=self.eos_token,
                                    extra_context=template_kwargs)


def _bos_eos_processor(backend: tokenizers.Tokenizer, bos: str | None, eos: str | None) -> processors.PostProcessor:
    """The post-processor a config's explicit ``add_bos_token``/``add_eos_token`` asks for: it
    replaces whatever tokenizer.json says, as transformers does for Llama-style tokenizers."""
    specials = [(t, backend.token_to_id(t)) for t in (bos, eos) if t is not None and backend.token_to_id(t) is not None]
    known = {t for t, _ in specials}
    prefix = f"{bos}:0 " if bos in known else ""
    suffix = f" {eos}:0" if eos in known else ""
    pair_prefix = f"{bos}:1 " if bos in known else ""
    pair_suffix = f" {eos}:1" if eos in known else ""
    return processors.TemplateProcessing(single=f"{prefix}$A:0{suffix}",
                                         pair=f"{prefix}$A:0{suffix} {pair_prefix}$B:1{pair_suffix}",
                                         special_tokens=specials)


def _encode(backend: tokenizers.Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    # encode_batch, not encode: the batch call releases the GIL while it tokenizes, the single one
    # held it for seconds on a rendered megabyte prompt, stalling the server's event loop (/health).
    return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
