"""GrammarCompiler: clear errors for bad constraints, a cache of results and failures, compilation
off the caller's thread with a timeout."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import xgrammar

from kiln.runtime.grammar import GrammarError

# (kind, constraint, what the message starts with, what else it says)
BAD_CONSTRAINTS = [
    ("regex", "(ab", "invalid regex: Regex parsing error", "parenthesis is not closed"),
    ("ebnf", 'root ::= item\nthing ::= "a"', "invalid ebnf: EBNF parser error at line 1", 'Rule "item" is not defined'),
    ("ebnf", 'root ::= "a" |', "invalid ebnf: EBNF parser error", "Expect element"),
    ("json_schema", '{"type": "object",', "invalid json_schema: not valid JSON", "line 1 column 19"),
    ("json_schema", {"type": "frobnicate"}, "invalid json_schema: ", 'Unsupported type "frobnicate"'),
    ("json_schema", {"properties": {"a": {"$ref": "#/$defs/missing"}}}, "invalid json_schema: ", "$defs"),
    ("json_schema", "[1, 2]", "invalid json_schema: ", "should be an object or bool"),
    ("structural_tag", "{}", "invalid structural_tag: ", "format"),
]


def counting(compiler, monkeypatch) -> list[tuple[str, str]]:
    """Record every real compilation the compiler starts."""
    calls: list[tuple[str, str]] = []
    original = compiler._compile_now

    def compile_now(kind: str, text: str):
        calls.append((kind, text))
        return original(kind, text)

    monkeypatch.setattr(compiler, "_compile_now", compile_now)
    return calls


@pytest.mark.parametrize(("kind", "constraint", "start", "detail"), BAD_CONSTRAINTS)
def test_bad_constraints_raise_a_clear_grammar_error(grammar_compiler, kind, constraint, start, detail):
    with pytest.raises(GrammarError) as raised:
        grammar_compiler.compile(kind, constraint)
    assert str(raised.value).startswith(start) and detail in str(raised.value), str(raised.value)
    assert "/project/cpp" not in str(raised.value) and "Check failed" not in str(raised.value)
    assert isinstance(raised.value, ValueError)


@pytest.mark.parametrize(("kind", "constraint"), [bad[:2] for bad in BAD_CONSTRAINTS])
def test_bad_constraints_are_refused_from_the_cache(new_compiler, monkeypatch, kind, constraint):
    compiler = new_compiler()
    calls = counting(compiler, monkeypatch)
    errors = []
    for _ in range(3):
        with pytest.raises(GrammarError) as raised:
            compiler.compile(kind, constraint)
        errors.append(str(raised.value))
    assert len(calls) == 1
    assert len(set(errors)) == 1


def test_good_constraints_compile_once(new_compiler, monkeypatch):
    compiler = new_compiler()
    calls = counting(compiler, monkeypatch)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    first = compiler.compile("json_schema", schema)
    assert isinstance(first, xgrammar.CompiledGrammar)
    assert compiler.compile("json_schema", dict(schema)) is first
    assert compiler.compile("regex", "[0-9]+") is compiler.compile("regex", "[0-9]+")
    compiler.compile("json_object")
    compiler.compile("json_object", "ignored")
    assert [kind for kind, _ in calls] == ["json_schema", "regex", "json_object"]


def test_kind_is_part_of_the_key(new_compiler, monkeypatch):
    compiler = new_compiler()
    calls = counting(compiler, monkeypatch)
    compiler.compile("regex", "a")
    compiler.compile("ebnf", 'root ::= "a"')
    compiler.compile("regex", 'root ::= "a"')
    assert len(calls) == 3


def test_unknown_kind_and_wrong_types_are_grammar_errors(grammar_compiler):
    with pytest.raises(GrammarError, match="unknown constraint kind 'grammar'"):
        grammar_compiler.compile_async("grammar", "x")
    with pytest.raises(GrammarError, match="regex must be a string"):
        grammar_compiler.compile_async("regex", {"a": 1})
    with pytest.raises(GrammarError, match="json_schema is not serializable"):
        grammar_compiler.compile_async("json_schema", {"type": float("nan")})


def test_cache_evicts_the_least_recently_used(new_compiler, monkeypatch):
    compiler = new_compiler(max_cache_entries=2)
    calls = counting(compiler, monkeypatch)
    for pattern in ["a", "b", "a", "c", "a", "b"]:
        compiler.compile("regex", pattern)
    # "a" stays (used last before "c" came), "b" was evicted by "c" and compiles again.
    assert [text for _, text in calls] == ["a", "b", "c", "b"]


def test_concurrent_requests_share_one_compilation(new_compiler, monkeypatch):
    compiler = new_compiler()
    calls = counting(compiler, monkeypatch)
    schema = {"type": "array", "items": {"type": "string", "maxLength": 3}}
    with ThreadPoolExecutor(max_workers=8) as callers:
        results = list(callers.map(lambda _: compiler.compile("json_schema", schema), range(16)))
    assert len(calls) == 1
    assert all(result is results[0] for result in results)


def test_compilation_runs_off_the_callers_thread(new_compiler, monkeypatch):
    compiler = new_compiler()
    threads: list[str] = []
    original = compiler._compile_now

    def compile_now(kind: str, text: str):
        threads.append(threading.current_thread().name)
        return original(kind, text)

    monkeypatch.setattr(compiler, "_compile_now", compile_now)
    future = compiler.compile_async("regex", "x+")
    assert isinstance(future.result(timeout=30), xgrammar.CompiledGrammar)
    assert threads[0].startswith("kiln-grammar") and threads[0] != threading.current_thread().name


def test_timeout_raises_and_the_compilation_finishes_into_the_cache(new_compiler, monkeypatch):
    compiler = new_compiler()
    release = threading.Event()
    calls: list[str] = []
    original = compiler._compile_now

    def slow_compile_now(kind: str, text: str):
        calls.append(text)
        release.wait(timeout=30)
        return original(kind, text)

    monkeypatch.setattr(compiler, "_compile_now", slow_compile_now)
    with pytest.raises(GrammarError, match=r"compiling the regex constraint took longer than 0.05s"):
        compiler.compile("regex", "slow", timeout=0.05)
    with pytest.raises(GrammarError, match="took longer than"):
        compiler.compile("regex", "slow", timeout=0.05)
    release.set()
    assert isinstance(compiler.compile("regex", "slow", timeout=30), xgrammar.CompiledGrammar)
    assert calls == ["slow"]


def test_default_timeout_applies(new_compiler, monkeypatch):
    compiler = new_compiler(timeout_s=0.05)
    release = threading.Event()
    monkeypatch.setattr(compiler, "_compile_now", lambda kind, text: release.wait(timeout=30))
    with pytest.raises(GrammarError, match="took longer than 0.05s"):
        compiler.compile("ebnf", 'root ::= "a"')
    release.set()
