"""Streaming text out of generated tokens: incremental detokenization and stop strings.

``IncrementalDetokenizer`` turns token ids, fed as they are sampled, into text deltas whose
concatenation is the decoded text. Decoding token by token and concatenating is wrong twice over:
one character may span several tokens (multi-byte UTF-8 split by byte-level BPE or byte-fallback
tokens), and decoders rewrite text depending on context (SentencePiece's ``▁`` becomes a space
except at the start). So each step decodes a short window: the tokens from ``prefix_offset``
(the start of the last emitted chunk, giving context) to the end, and emits what it adds beyond the
decode of ``prefix_offset:read_offset`` (the text already emitted from that window). A decode that
ends in U+FFFD is an incomplete character: nothing is emitted and the window grows until the
character completes; ``finish`` emits whatever remains, replacement characters included, when
the sequence really ends on invalid bytes. For valid UTF-8 the deltas join to ``decode(all ids)``;
for invalid bytes they can differ where a decoder replaces a whole run of byte tokens once any of
it is invalid (tokenizers' ByteFallback does), since the stream has already sent the valid bytes
before the bad one and never takes text back. That is two decodes of the window a token (~8 us on
a server's CPU, per token of every stream): where decoding is only concatenating the tokens' bytes
(``Tokenizer.decodes_bytes``: byte-level BPE), ``ByteLevelDetokenizer`` reads each token's cached
bytes through an incremental UTF-8 decoder instead, which holds an unfinished character by itself
(``detokenizer_for`` picks).

``StopChecker`` watches that text for stop strings: it says when one occurred (the output is cut
before it) and holds back a tail that could still become one, so a client never sees text that a
stop string later removes. It matches on Python strings, whose units are whole characters, and the
detokenizer never emits part of a character, so a cut never falls inside one. It also searches stop
regexes (``re`` patterns) in the whole text after each delta, since a match may need text yet to
come; no tail can be held back for a pattern, so a match that begins in text already streamed cuts
the output where the streamed text ends.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from .tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context for the first generated ones (enough for a decoder's
# context-dependent rules, such as SentencePiece's leading-space strip, to see real text).
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Text deltas for one sequence's generated tokens.

    With ``prompt_ids`` the first token's text is decoded in the context of the prompt's last few
    tokens, so a SentencePiece word-start token keeps its leading space (``" Hello"``); without it
    the deltas join to exactly ``tokenizer.decode(generated_ids)``, which strips that space.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        self._num_context = len(self._ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    @property
    def output_ids(self) -> list[int]:
        """The generated ids fed so far."""
        return self._ids[self._num_context:]

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Feed one id or several; return the new text that is complete (possibly empty)."""
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        # One id at a time, so that complete text before an unfinished character is not held.
        return "".join(self._add_one(token_id) for token_id in ids)

    def finish(self) -> str:
        """The text still held back (an unfinished character) once the sequence has ended."""
        return self._emit(self._decode_window(), force=True)

    def _add_one(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._emit(self._decode_window(), force=False)

    def _decode_window(self) -> tuple[str, str]:
        decode = self.tokenizer.decode_raw
        prefix = decode(self._ids[self._prefix_offset:self._read_offset], self.skip_special_tokens)
        full = decode(self._ids[self._prefix_offset:], self.skip_special_tokens)
        return prefix, full

    def _emit(self, window: tuple[str, str], force: bool) -> str:
        prefix, full = window
        if len(full) <= len(prefix) or (full.endswith(REPLACEMENT_CHAR) and not force):
            return ""
        delta = full[len(prefix):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta


class ByteLevelDetokenizer:
    """``IncrementalDetokenizer``'s deltas for a tokenizer whose decode is its tokens' bytes read as
    UTF-8 (``Tokenizer.decodes_bytes``): the deltas join to ``decode(generated ids)``, invalid bytes
    replaced as the decoder replaces them. No decoder rule looks at context, so the prompt is not
    needed. A server runs ``add`` for every token of every stream: ~1 us here against ~8 for the
    window's two decodes (codecs' own incremental decoder would add a Python frame a call)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._bytes_of = tokenizer.token_bytes.bytes_of
        self._skipped = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._pending = b""  # the start of a character whose other bytes have not arrived

    def add(self, token_ids: int | Sequence[int]) -> str:
        """Feed one id or several; return the new text that is complete (possibly empty)."""
        ids = (token_ids,) if isinstance(token_ids, int) else token_ids
        if len(ids) == 1:  # the common case: one token a step
            data = b"" if ids[0] in self._skipped else self._bytes_of(ids[0])
        else:
            data = b"".join([self._bytes_of(i) for i in ids if i not in self._skipped])
        return self._decode(self._pending + data, final=False)

    def finish(self) -> str:
        """An unfinished character's bytes, as U+FFFD, once the sequence has ended."""
        return self._decode(self._pending, final=True)

    def _decode(self, data: bytes, final: bool) -> str:
        text, used = codecs.utf_8_decode(data, "replace", final)
        self._pending = data[used:]
        return text


def detokenizer_for(tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                    skip_special_tokens: bool = True) -> IncrementalDetokenizer | ByteLevelDetokenizer:
    """The fastest detokenizer whose deltas are ``IncrementalDetokenizer``'s for this tokenizer."""
    if tokenizer.decodes_bytes:
        return ByteLevelDetokenizer(tokenizer, skip_special_tokens)
    return IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)


@dataclass(frozen=True)
class StopUpdate:
    """What to stream after one delta: ``text`` (may be empty), and whether a stop string or stop
    regex ended the output (``stop_string`` says which: the string, or the regex's pattern)."""

    text: str
    stopped: bool = False
    stop_string: str | None = None


def find_stop(text: str, stop_strings: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """The earliest stop string in ``text`` that ends after ``start``, as (index where it begins,
    the string), or None. Earlier occurrences were checked when their text arrived."""
    best: tuple[int, str] | None = None
    for stop in stop_strings:
        index = text.find(stop, max(0, start - len(stop) + 1))
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def find_stop_regex(text: str, patterns: Sequence[re.Pattern[str]]) -> tuple[int, str] | None:
    """The earliest match of any pattern in the whole of ``text``, as (index where it begins, the
    pattern's text), or None. The whole text each time: a match may begin in older text and need
    the newest to complete."""
    best: tuple[int, str] | None = None
    for pattern in patterns:
        match = pattern.search(text)
        if match is not None and (best is None or match.start() < best[0]):
            best = (match.start(), pattern.pattern)
    return best


def partial_stop_length(text: str, stop_strings: Sequence[str]) -> int:
    """How many trailing characters of ``text`` are the start of some stop string (and so may not
    be streamed yet)."""
    longest = 0
    for stop in stop_strings:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest


class StopChecker:
    """Stop-string handling over one sequence's growing output text.

    ``push(delta)`` after each detokenizer delta returns what may be streamed now; once it reports
    ``stopped`` the output is ``text`` (the stop string and anything after it removed) and the
    sequence should finish. When generation ends for another reason, ``flush()`` releases the
    held-back tail.
    """

    def __init__(self, stop_strings: Sequence[str], stop_regexes: Sequence[str] = ()) -> None:
        if any(not stop for stop in stop_strings):
            raise ValueError("stop strings must not be empty")
        self.stop_strings = tuple(stop_strings)
        # Compiled once per sample (``re`` also caches them across the samples of a request).
        self.stop_patterns = tuple(re.compile(pattern) for pattern in stop_regexes)
        self.text = ""
        self.stopped = False
        self.stop_string: str | None = None
        self._streamed = 0

    def push(self, delta: str) -> StopUpdate:
        if self.stopped:
            raise RuntimeError("push after a stop string ended the output")
        start = len(self.text)
        self.text += delta
        hit = find_stop(self.text, self.stop_strings, start)
        if self.stop_patterns:
            regex_hit = find_stop_regex(self.text, self.stop_patterns)
            if regex_hit is not None and (hit is None or regex_hit[0] < hit[0]):
                # What was streamed stays streamed: the cut falls no earlier than its end.
                hit = (max(regex_hit[0], self._streamed), regex_hit[1])
        if hit is not None:
            cut, stop = hit
            self.text = self.text[:cut]
            self.stopped = True
            self.stop_string = stop
            return StopUpdate(self._release(len(self.text)), stopped=True, stop_string=stop)
        return StopUpdate(self._release(len(self.text) - partial_stop_length(self.text, self.stop_strings)))

    def flush(self) -> str:
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        # The held-back tail can shrink (a partial match turns out not to be one) but what was
        # streamed never changes, so release only from the last streamed position onward.
        if upto <= self._streamed:
            return ""
        released = self.text[self._streamed:upto]
        self._streamed = upto
        return released
