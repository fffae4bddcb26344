"""Text that comes from users: checked to be valid Unicode, and kept from becoming special tokens.

A JSON string may hold a lone UTF-16 surrogate (``"\\ud800"``); Python keeps it in a ``str`` that
cannot be encoded, and the tokenizer fails on it. ``require_unicode`` refuses such text (kiln does
not replace it: a silently changed prompt is worse than a clear 400).

Special tokens typed by a user (``<|im_start|>``) must stay text, or a user could forge a system
turn. ``mask_special_tokens`` swaps them, in every string of the data a chat template will read,
for placeholders the tokenizer cannot mistake for markup; after rendering, the special tokens left
in the prompt are the template's own, and ``unmask`` puts the user's text back.
"""

from __future__ import annotations

import re
import uuid
from typing import Any, Collection


def first_surrogate(text: str) -> int | None:
    """The index of the first lone surrogate in ``text``, None when it is valid Unicode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return error.start
    return None


def require_unicode(text: str, what: str) -> None:
    """Raises ``ValueError`` naming ``what`` when ``text`` is not valid Unicode."""
    index = first_surrogate(text)
    if index is not None:
        raise ValueError(f"{what}: not valid Unicode: a lone UTF-16 surrogate (U+{ord(text[index]):04X}) at "
                         f"character {index}; send text as UTF-8 or as paired \\u escapes (refused, not replaced)")


class SpecialTokenMask:
    """Placeholders for the special tokens of one tokenizer, unique to this mask."""

    def __init__(self, special_tokens: Collection[str]) -> None:
        nonce = uuid.uuid4().hex
        ordered = sorted(special_tokens, key=len, reverse=True)  # longest first: no prefix wins
        self._placeholders = {token: f"\ue000{nonce}{index}\ue001" for index, token in enumerate(ordered)}
        self._originals = {placeholder: token for token, placeholder in self._placeholders.items()}
        self._specials = re.compile("|".join(re.escape(t) for t in ordered)) if ordered else None
        self._masked = re.compile("|".join(re.escape(p) for p in self._originals)) if ordered else None
        self.replaced = 0

    def mask(self, value: Any) -> Any:
        """A copy of ``value`` (strings, lists, mappings) with special tokens in strings replaced."""
        if isinstance(value, str):
            if self._specials is None:
                return value
            masked, count = self._specials.subn(lambda m: self._placeholders[m.group(0)], value)
            self.replaced += count
            return masked
        if isinstance(value, dict):
            return {key: self.mask(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.mask(item) for item in value]
        return value

    def unmask(self, text: str) -> str:
        return self._masked.sub(lambda m: self._originals[m.group(0)], text) if self._masked else text

    def split(self, text: str) -> list[tuple[str, bool]]:
        """``text`` cut at its special tokens: ``(piece, is_special)`` in order, empty pieces left out."""
        if self._specials is None:
            return [(text, False)] if text else []
        pieces: list[tuple[str, bool]] = []
        position = 0
        for match in self._specials.finditer(text):
            if match.start() > position:
                pieces.append((text[position:match.start()], False))
            pieces.append((match.group(0), True))
            position = match.end()
        if position < len(text):
            pieces.append((text[position:], False))
        return pieces
