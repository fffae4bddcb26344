"""body.parse_body: JSON checked before routes see it (encoding, nesting, message count, Unicode)."""

from __future__ import annotations

import json

import pytest

from kiln.server.body import BodyLimits, parse_body
from kiln.server.errors import APIError

LIMITS = BodyLimits(max_depth=8, max_messages=3)


def refused(body: bytes) -> APIError:
    with pytest.raises(APIError) as caught:
        parse_body(body, LIMITS)
    assert caught.value.status == 400
    return caught.value


def test_valid_bodies_parse():
    assert parse_body(b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}', LIMITS) == {
        "messages": [{"role": "user", "content": "😀"}]}


def test_encoding_and_syntax_errors_have_codes():
    assert refused(b'{"prompt": "\xff"}').code == "invalid_encoding"
    error = refused(b'{"prompt": ')
    assert error.code == "invalid_json" and "line 1" in error.message


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": "a\ud800"}]}, "messages[0].content"),
    ({"prompt": ["ok", "\udfff"]}, "prompt[1]"),
    ({"stop": "\ud800"}, "stop"),
    ({"logit_bias": {"\ud800": 1}}, "logit_bias"),  # a key
])
def test_lone_surrogates_are_refused_where_they_are(body, param):
    error = refused(json.dumps(body).encode())
    assert error.code == "invalid_unicode" and error.param == param
    assert error.message.startswith(param) and "refused, not replaced" in error.message


def test_nesting_and_message_count_are_limited():
    error = refused(json.dumps({"response_format": [[[[[[[[["deep"]]]]]]]]]}).encode())
    assert error.code == "nesting_too_deep" and "8 levels" in error.message
    assert refused(b"[" * 100_000 + b"]" * 100_000).code == "nesting_too_deep"  # past Python's recursion limit
    error = refused(json.dumps({"messages": [{"role": "user", "content": "x"}] * 4}).encode())
    assert (error.code, error.param) == ("too_many_messages", "messages") and "at most 3" in error.message
