"""Uniform random walks over what a grammar allows always end in text the constraint accepts:
JSON that parses and validates against its schema, regex full matches, parseable expressions."""

from __future__ import annotations

import ast
import json
import re

import jsonschema
import pytest

from kiln.runtime.grammar import GrammarState, allocate_bitmask

from .conftest import PADDED_VOCAB, allowed_ids

SEEDS = (0, 1, 2)

SCHEMAS = {
    "nested_object": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 10},
                               "zip": {"type": "string", "pattern": "[0-9]{5}"}},
                "required": ["city", "zip"],
            },
            "nickname": {"type": "string", "maxLength": 6},
        },
        "required": ["name", "age", "address"],
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": -5, "maximum": 5},
                           "ok": {"type": "boolean"}, "note": {"type": "null"}},
            "required": ["id", "ok"],
        },
        "minItems": 1,
        "maxItems": 3,
    },
    "enums_and_numbers": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
            "score": {"type": "number", "minimum": 0.5, "maximum": 9.75},
            "level": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 4},
        },
        "required": ["color", "size", "score", "level"],
    },
    "any_of": {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                           {"type": "string", "maxLength": 4}]}},
        "required": ["value"],
    },
}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_walks_validate(grammar_compiler, walk_text, name, seed):
    schema = SCHEMAS[name]
    text = walk_text(GrammarState(grammar_compiler.compile("json_schema", schema)), seed)
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("seed", SEEDS)
def test_schema_given_as_text_walks_validate(grammar_compiler, walk_text, seed):
    schema = SCHEMAS["nested_object"]
    text = walk_text(GrammarState(grammar_compiler.compile("json_schema", json.dumps(schema, indent=2))), seed)
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("document", [{}, {"a": 1}, {"name": "Ada", "tags": ["x", "y"], "nested": {"ok": True, "n": None}}])
def test_json_object_accepts_objects_as_the_tokenizer_spells_them(grammar_compiler, smollm2_tokenizer, document):
    # Free strings make uniform walks too long to end, so json_object is checked on real documents:
    # every token of their natural tokenization is allowed, then the stop token ends them.
    state = GrammarState(grammar_compiler.compile("json_object"))
    bitmask = allocate_bitmask(1, PADDED_VOCAB)
    for token in smollm2_tokenizer.encode(json.dumps(document), add_special_tokens=False):
        state.fill_bitmask(bitmask, 0)
        assert token in allowed_ids(bitmask[0].numpy(), PADDED_VOCAB)
        assert state.accept(token)
    state.fill_bitmask(bitmask, 0)
    assert allowed_ids(bitmask[0].numpy(), PADDED_VOCAB).tolist() == sorted(smollm2_tokenizer.eos_token_ids)
    assert state.accept(smollm2_tokenizer.eos_token_id) and state.is_terminated()


@pytest.mark.parametrize("text", ["[1]", '"s"', "1", "null"])
def test_json_object_refuses_other_values(grammar_compiler, smollm2_tokenizer, text):
    state = GrammarState(grammar_compiler.compile("json_object"))
    assert not state.accept(smollm2_tokenizer.encode(text, add_special_tokens=False)[0])


REGEXES = [r"\d{3}-\d{4}", r"(cat|dog)s? [a-z]{1,8}", r"[A-Z][a-z]{0,5}@[a-z]{1,5}\.(com|org)", r"(ab|c)*d"]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_walks_fullmatch(grammar_compiler, walk_text, pattern, seed):
    text = walk_text(GrammarState(grammar_compiler.compile("regex", pattern)), seed)
    assert re.fullmatch(pattern, text), text


ARITHMETIC = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= "0" | [1-9] [0-9]*
"""
_ARITHMETIC_NODES = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)


@pytest.mark.parametrize("seed", SEEDS)
def test_ebnf_walks_parse_as_arithmetic(grammar_compiler, walk_text, seed):
    text = walk_text(GrammarState(grammar_compiler.compile("ebnf", ARITHMETIC)), seed)
    assert re.fullmatch(r"[0-9+\-*/()]+", text), text
    tree = ast.parse(text, mode="eval")
    assert all(isinstance(node, _ARITHMETIC_NODES) for node in ast.walk(tree)), text
    assert all(isinstance(node.value, int) for node in ast.walk(tree) if isinstance(node, ast.Constant))
