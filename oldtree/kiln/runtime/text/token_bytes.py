"""The raw bytes of single tokens: for logprobs (OpenAI reports each token's text and its UTF-8 bytes)
and for the byte-level detokenizer (``detokenizer.ByteLevelDetokenizer``), which streams text by
concatenating them.

Decoding one token alone loses bytes whenever a token holds part of a multi-byte character (the
decoder returns U+FFFD). The vocabulary spells those bytes exactly, in one of two ways:
byte-level BPE (GPT-2, Llama 3, SmolLM2, Qwen) maps every byte to a printable character, and
SentencePiece byte fallback writes ``<0xNN>``. Other tokens are decoded as text.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from tokenizers import decoders

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_table() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted (character -> byte): printable
    bytes stand for themselves, the others are shifted to code points from 256 up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [byte for byte in range(256) if byte not in printable]
    return {**{chr(byte): byte for byte in printable}, **{chr(256 + n): byte for n, byte in enumerate(others)}}


BYTE_LEVEL_CHARS = _byte_level_table()


def byte_level_bytes(piece: str) -> bytes:
    """What a ``ByteLevel`` decoder makes of one token string: its characters' bytes when every one is
    in the table, else the string's own UTF-8 (a token spelled outside the alphabet, such as an
    added token with a space in it)."""
    if all(char in BYTE_LEVEL_CHARS for char in piece):
        return bytes(BYTE_LEVEL_CHARS[char] for char in piece)
    return piece.encode()


def is_byte_level(decoder: object) -> bool:
    return isinstance(decoder, decoders.ByteLevel)


class TokenBytes:
    """``bytes_of(token_id)``, cached: a server sees the same few thousand tokens again and again."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._byte_level = tokenizer is not None and is_byte_level(tokenizer.backend.decoder)
        self._cache: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._compute(token_id)
        return cached

    def _compute(self, token_id: int) -> bytes:
        if self.tokenizer is None:
            return b""
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level:
            return byte_level_bytes(piece)
        if token_id in self.tokenizer.special_token_ids:
            return piece.encode()
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        return self.tokenizer.decode_raw([token_id], skip_special_tokens=False).encode()
