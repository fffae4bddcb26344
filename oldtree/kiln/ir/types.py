"""Tensor types of the IR: element dtypes and shapes whose dimensions are ints or symbols.

A symbol names a size known only when a step runs (``T`` tokens in the step, ``B`` sequences,
``NS`` KV-pool slots, ...). Types print as ``bf16[T, 576]`` and parse back from that text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Mapping, Union

Dim = Union[int, str]


class DType(str, Enum):
    f32 = "f32"
    f16 = "f16"
    bf16 = "bf16"
    i64 = "i64"
    i32 = "i32"
    i8 = "i8"
    u8 = "u8"
    f8e4m3 = "f8e4m3"  # a storage dtype (quantized weights, an FP8 KV pool), not of activations

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def is_float(self) -> bool:
        return self in (DType.f32, DType.f16, DType.bf16, DType.f8e4m3)

    def __str__(self) -> str:
        return self.value


_ITEMSIZE = {DType.f32: 4, DType.f16: 2, DType.bf16: 2, DType.i64: 8, DType.i32: 4, DType.i8: 1, DType.u8: 1,
             DType.f8e4m3: 1}

_SYMBOL = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class TensorType:
    shape: tuple[Dim, ...]
    dtype: DType

    def __post_init__(self) -> None:
        for dim in self.shape:
            if isinstance(dim, bool) or not isinstance(dim, (int, str)):
                raise TypeError(f"dimension {dim!r} must be an int or a symbol name")
            if isinstance(dim, int) and dim < 0:
                raise ValueError(f"dimension {dim} is negative")
            if isinstance(dim, str) and not _SYMBOL.match(dim):
                raise ValueError(f"symbol {dim!r} is not a valid name")

    @property
    def rank(self) -> int:
        return len(self.shape)

    def with_shape(self, shape: tuple[Dim, ...]) -> "TensorType":
        return TensorType(tuple(shape), self.dtype)

    def with_dtype(self, dtype: DType) -> "TensorType":
        return TensorType(self.shape, dtype)

    def symbols(self) -> set[str]:
        return {d for d in self.shape if isinstance(d, str)}

    def concrete_shape(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        """The shape with every symbol replaced by its size in ``sizes``."""
        try:
            return tuple(d if isinstance(d, int) else int(sizes[d]) for d in self.shape)
        except KeyError as missing:
            raise KeyError(f"no size given for symbol {missing.args[0]!r} of {self}") from None

    def nbytes(self, sizes: Mapping[str, int]) -> int:
        count = 1
        for d in self.concrete_shape(sizes):
            count *= d
        return count * self.dtype.itemsize

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(str(d) for d in self.shape)}]"

    @staticmethod
    def parse(text: str) -> "TensorType":
        match = re.fullmatch(r"\s*([a-z0-9]+)\[(.*)\]\s*", text)
        if not match:
            raise ValueError(f"cannot parse tensor type {text!r}")
        dtype = DType(match.group(1))
        body = match.group(2).strip()
        dims: list[Dim] = []
        if body:
            for part in body.split(","):
                part = part.strip()
                dims.append(int(part) if part.lstrip("-").isdigit() else part)
        return TensorType(tuple(dims), dtype)


def same_dim(a: Dim, b: Dim) -> bool:
    """Dims are equal when both are the same int or the same symbol."""
    return type(a) is type(b) and a == b
