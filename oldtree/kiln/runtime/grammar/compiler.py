"""Compiling a request's output constraint into an xgrammar ``CompiledGrammar``, cached, off-thread.

Constraint kinds: ``json_schema`` (a schema as JSON text or a dict), ``json_object`` (any JSON
object; its text is ignored), ``regex``, ``ebnf`` (xgrammar's GBNF dialect, root rule ``root``) and
``structural_tag`` (xgrammar's structural-tag JSON).

Compilation runs on a small thread pool (xgrammar releases the GIL while it compiles), so neither the
scheduler nor the HTTP loop waits on it. The cache maps (kind, constraint text) to the *future* of
its compilation: concurrent requests with one constraint share one compilation, and a constraint
that failed keeps its error, so a repeated bad constraint is refused without compiling it again. The
cache is least-recently-used and bounded in entries. A caller's timeout bounds only its own wait: a
compilation cannot be interrupted, so it finishes in the pool and its result stays cached.

Every failure reaches the caller as ``GrammarError`` (a ``ValueError``) naming the constraint kind and
the problem, which the engine reports for that request alone (HTTP 400).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Iterable, Mapping

import xgrammar

from ..text.tokenizer import Tokenizer
from .tokenizer_info import build_tokenizer_info

logger = logging.getLogger(__name__)

CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "ebnf", "structural_tag")
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_CACHE_ENTRIES = 1024

# xgrammar's C++ errors read "[14:16:59] /project/cpp/regex_converter.cc:94: <message>", sometimes
# with "Check failed: (<expr>) is false: " before the message; a client needs only the message.
_CPP_LOCATION = re.compile(r"^\s*\[[\d:.]+\]\s+\S+:\d+:\s*")
_CHECK_FAILED = re.compile(r"^Check failed: \(.*?\) is false:\s*")

CacheKey = tuple[str, str]


class GrammarError(ValueError):
    """A constraint that cannot be used: malformed, unsupported, or too slow to compile."""


def _clean_message(error: BaseException) -> str:
    message = _CHECK_FAILED.sub("", _CPP_LOCATION.sub("", str(error))).strip()
    return message or type(error).__name__


def constraint_text(kind: str, constraint: str | Mapping[str, Any] | None) -> str:
    """The text that identifies a constraint in the cache (dict schemas as compact JSON, key order
    kept: xgrammar emits properties in the schema's order)."""
    if kind not in CONSTRAINT_KINDS:
        raise GrammarError(f"unknown constraint kind {kind!r}; expected one of {', '.join(CONSTRAINT_KINDS)}")
    if kind == "json_object":
        return ""
    if isinstance(constraint, Mapping) and kind in ("json_schema", "structural_tag"):
        try:
            return json.dumps(constraint, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as error:
            raise GrammarError(f"{kind} is not serializable as JSON: {error}") from None
    if not isinstance(constraint, str):
        raise GrammarError(f"{kind} must be a string, got {type(constraint).__name__}")
    return constraint


class GrammarCompiler:
    """Compiles constraints for one model's vocabulary; one instance serves the whole engine.

    ``tokenizer`` is a kiln ``Tokenizer`` or its HF-layout directory; ``vocab_size`` is the model's
    logits width (it may exceed the tokenizer's vocabulary: the extra ids are never allowed).
    ``any_whitespace`` lets JSON output hold arbitrary whitespace between tokens; off by default, as
    free whitespace lets small models loop on newlines instead of closing the object.
    """

    def __init__(self, tokenizer: Tokenizer | str | os.PathLike[str], vocab_size: int, *,
                 max_threads: int = 4, stop_token_ids: Iterable[int] | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, max_cache_entries: int = DEFAULT_CACHE_ENTRIES,
                 any_whitespace: bool = False) -> None:
        if max_threads < 1 or max_cache_entries < 1:
            raise ValueError("max_threads and max_cache_entries must be >= 1")
        self.tokenizer_info = build_tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = vocab_size
        self.stop_token_ids: tuple[int, ...] = tuple(self.tokenizer_info.stop_token_ids)
        self.timeout_s = timeout_s
        self.any_whitespace = any_whitespace
        # xgrammar's own cache stays off: this one bounds memory and also remembers failures.
        self._xgrammar = xgrammar.GrammarCompiler(self.tokenizer_info, max_threads=max_threads,
                                                  cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="kiln-grammar")
        self._cache: OrderedDict[CacheKey, Future[xgrammar.CompiledGrammar]] = OrderedDict()
        self._max_cache_entries = max_cache_entries
        self._lock = threading.Lock()

    def compile_async(self, kind: str, constraint: str | Mapping[str, Any] | None = None
                      ) -> Future[xgrammar.CompiledGrammar]:
        """The future of the compiled constraint: from the cache when this (kind, text) was seen,
        else a new compilation on the pool. A failed future holds a ``GrammarError``; prefer
        ``compile`` (or ``result``) to read it, which also bound the wait."""
        key = (kind, constraint_text(kind, constraint))
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile_entry, *key)
            self._cache[key] = future
            while len(self._cache) > self._max_cache_entries:
                self._cache.popitem(last=False)
        return future

    def compile(self, kind: str, constraint: str | Mapping[str, Any] | None = None,
                timeout: float | None = None) -> xgrammar.CompiledGrammar:
        """The compiled constraint, waiting at most ``timeout`` seconds (default ``timeout_s``)."""
        return self.result(self.compile_async(kind, constraint), kind, timeout)

    def result(self, future: Future[xgrammar.CompiledGrammar], kind: str,
               timeout: float | None = None) -> xgrammar.CompiledGrammar:
        """Wait for a future from ``compile_async``; a timeout or a bad constraint raises GrammarError."""
        wait = self.timeout_s if timeout is None else timeout
        try:
            return future.result(timeout=wait)
        except FutureTimeout:
            raise GrammarError(f"compiling the {kind} constraint took longer than {wait:g}s") from None
        except GrammarError as error:
            # A fresh exception: re-raising the cached one would grow its traceback on every hit.
            raise GrammarError(str(error)) from None

    def close(self) -> None:
        """Stop the pool; queued compilations are cancelled, running ones finish in the background."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile_entry(self, kind: str, text: str) -> xgrammar.CompiledGrammar:
        started = time.perf_counter()
        try:
            compiled = self._compile_now(kind, text)
        except GrammarError:
            raise
        except Exception as error:  # xgrammar raises RuntimeError (and its subclasses) for bad input
            raise GrammarError(f"invalid {kind}: {_clean_message(error)}") from None
        logger.debug("compiled a %s constraint in %.1f ms", kind, 1e3 * (time.perf_counter() - started))
        return compiled

    def _compile_now(self, kind: str, text: str) -> xgrammar.CompiledGrammar:
        """One xgrammar compilation; runs on the pool."""
        compilers: dict[str, Callable[[str], xgrammar.CompiledGrammar]] = {
            "json_schema": self._compile_json_schema,
            "json_object": lambda _: self._compile_json_schema('{"type": "object"}'),
            "regex": self._xgrammar.compile_regex,
            "ebnf": self._xgrammar.compile_grammar,
            "structural_tag": self._xgrammar.compile_structural_tag,
        }
        return compilers[kind](text)

    def _compile_json_schema(self, text: str) -> xgrammar.CompiledGrammar:
        # Parsed here first: Python's message locates a syntax error better than xgrammar's.
        try:
            json.loads(text)
        except json.JSONDecodeError as error:
            raise GrammarError(f"invalid json_schema: not valid JSON ({error})") from None
        return self._xgrammar.compile_json_schema(text, any_whitespace=self.any_whitespace)
