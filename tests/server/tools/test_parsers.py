"""Each tool-call format's parser against its structural tag: the grammar compiled for SmolLM2's
vocabulary accepts the format's canonical text (and nothing else where calls are required), and
the parser reads the calls back out of it."""

from __future__ import annotations

import pytest
import xgrammar

from kiln.runtime.grammar import GrammarCompiler
from kiln.runtime.text.tokenizer import Tokenizer
from kiln.server.tools import formats
from kiln.server.tools.parsers import PARSERS, FunctionSpec, ParsedCall, get_parser, parser_for_template

WEATHER = FunctionSpec("get_weather", {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]})
NO_ARGS = FunctionSpec("ping", {"type": "object", "properties": {}})
CALLS = [ParsedCall("get_weather", {"city": "Paris", "unit": "c"}), ParsedCall("ping", {})]
TEXTS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>',
    "llama3": '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; {"name": "ping", "parameters": {}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
               '{"name": "ping", "arguments": {}}]',
    "pythonic": '[get_weather(city="Paris", unit="c"), ping()]',
}


@pytest.fixture(scope="module")
def compiler(smollm2_dir):
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, stop_token_ids=tokenizer.eos_token_ids)
    yield compiler
    compiler.close()


def _matcher(compiler, format) -> xgrammar.GrammarMatcher:
    return xgrammar.GrammarMatcher(compiler.compile("structural_tag", formats.structural_tag(format)))


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_required_format_accepts_exactly_the_calls(compiler, name):
    parser = get_parser(name)
    matcher = _matcher(compiler, parser.required_format([WEATHER, NO_ARGS], parallel=True))
    assert matcher.accept_string(TEXTS[name])
    assert matcher.accept_token(next(iter(compiler.stop_token_ids))) and matcher.is_terminated()
    assert not _matcher(compiler, parser.required_format([WEATHER, NO_ARGS], True)).accept_string("Hello")
    content, calls = parser.parse(TEXTS[name])
    assert content.strip() == "" and calls == CALLS


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_auto_format_allows_text_then_constrains_the_call(compiler, name):
    parser = get_parser(name)
    text = "Let me check. " + TEXTS[name]
    assert _matcher(compiler, parser.auto_format([WEATHER, NO_ARGS], parallel=True)).accept_string(text)
    content, calls = parser.parse(text)
    assert content.strip() == "Let me check." and calls == CALLS
    opening = parser.starts[-1]
    # From the opening on, a call to an unknown function is out of the grammar.
    bad = {"hermes": '<tool_call>\n{"name": "nope"', "llama3": '{"name": "nope"', "mistral": '[TOOL_CALLS][{"name": "nope"',
           "pythonic": "[nope("}[name]
    assert bad.startswith(opening)
    assert not _matcher(compiler, parser.auto_format([WEATHER], True)).accept_string("Hi " + bad)


def test_single_call_when_not_parallel(compiler):
    parser = get_parser("hermes")
    matcher = _matcher(compiler, parser.required_format([WEATHER, NO_ARGS], parallel=False))
    first, second = TEXTS["hermes"].split("\n<tool_call>")
    assert matcher.accept_string(first)
    assert not matcher.accept_string("\n<tool_call>")


def test_pythonic_arguments_keep_required_and_optional_order(compiler):
    parser = get_parser("pythonic")
    optional_only = FunctionSpec("f", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}})
    for text in ("[f()]", "[f(a=1)]", "[f(b=true)]", "[f(a=1, b=false)]"):
        assert _matcher(compiler, parser.required_format([optional_only], True)).accept_string(text), text
    assert not _matcher(compiler, parser.required_format([optional_only], True)).accept_string("[f(b=true, a=1)]")
    assert parser.parse("[f(a=1, b=false)]") == ("", [ParsedCall("f", {"a": 1, "b": False})])


def test_text_without_calls_is_content():
    for name in PARSERS:
        assert get_parser(name).parse("Just text. ") == ("Just text. ", [])


def test_malformed_call_raises():
    with pytest.raises(ValueError):
        get_parser("hermes").parse('<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>')


def test_parser_from_template_and_unknown_name():
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for_template("{{ '<|python_tag|>' }}") == "llama3"
    assert parser_for_template(None) == "hermes"
    with pytest.raises(ValueError, match="unknown tool-call parser 'xml'.*hermes, llama3, mistral, pythonic"):
        get_parser("xml")
