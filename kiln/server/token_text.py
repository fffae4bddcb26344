"""The raw bytes of single tokens, for logprobs (OpenAI reports each token's text and its UTF-8 bytes).

Decoding one token alone loses bytes whenever a token holds part of a multi-byte character (the
decoder returns U+FFFD). The vocabulary spells those bytes exactly, in one of two ways:
byte-level BPE (GPT-2, Llama 3, SmolLM2) maps every byte to a printable character, and
SentencePiece byte fallback writes ``<0xNN>``. Other tokens are decoded as text.
"""

from __future__ import annotations

import re

from tokenizers import decoders

from kiln.runtime.text.tokenizer import Tokenizer

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_table() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted (character -> byte)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    shift = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + shift)
            shift += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_LEVEL = _byte_level_table()


class TokenBytes:
    """``bytes_of(token_id)``, cached: a server sees the same few thousand tokens again and again."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._byte_level = tokenizer is not None and _is_byte_level(tokenizer.backend.decoder)
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
        if token_id in self.tokenizer.special_token_ids:
            return piece.encode()
        if self._byte_level and all(ch in _BYTE_LEVEL for ch in piece):
            return bytes(_BYTE_LEVEL[ch] for ch in piece)
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        return self.tokenizer.decode_raw([token_id], skip_special_tokens=False).encode()


def _is_byte_level(decoder: object) -> bool:
    return isinstance(decoder, decoders.ByteLevel)
