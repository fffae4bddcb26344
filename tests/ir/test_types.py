"""Tensor types: printing, parsing, symbolic sizes."""

import pytest

from kiln.ir import DType, TensorType


def test_print_and_parse_round_trip():
    for text in ["bf16[T, 576]", "i32[T]", "f32[]", "f16[B, P, 3]"]:
        assert str(TensorType.parse(text)) == text


def test_nbytes_uses_symbol_sizes():
    t = TensorType(("T", 576), DType.bf16)
    assert t.nbytes({"T": 10}) == 10 * 576 * 2
    with pytest.raises(KeyError, match="symbol 'T'"):
        t.nbytes({})


@pytest.mark.parametrize("bad", [(-1,), ("1x",), (1.5,), (True,)])
def test_rejects_bad_dims(bad):
    with pytest.raises((TypeError, ValueError)):
        TensorType(bad, DType.f32)


def test_parse_rejects_garbage():
    with pytest.raises(ValueError):
        TensorType.parse("bf16(T)")
