"""Weight formats and placements: how a parameter's stored bytes are read, and how ranks hold it.

A parameter's type is its storage (``i8[16, 64]``). Its ``WeightFormat`` says how to read that
storage as the weight an op computes with: plain (as it is) or quantized (a ``QuantScheme`` and the
names of its scale parameters). Its ``Placement`` says how tensor- or expert-parallel ranks hold it.
Both are small frozen values that print on the parameter's line and parse back:

    param @w: i8[16, 64] format=int8_channel(@w.scale) placement=column(0)
    param @w.scale: f32[16]

Ops see a quantized parameter as a ``QuantizedType``: its storage type carrying its format, so a
type rule can tell a quantized weight from a plain one of another dtype.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Any

from .types import Dim, DType, TensorType


@dataclass(frozen=True)
class QuantScheme:
    """A quantization scheme. ``storage`` is the dtype of the stored values, ``pack`` how many values
    one stored element holds along the last axis (two 4-bit values a byte). Each row has one scale
    of ``scale_dtype`` per ``block`` values along the last axis, or one per row (per output channel)
    when ``block`` is None. ``kiln/kernels/quantize.py`` holds each scheme's reference encoding."""

    name: str
    storage: DType
    scale_dtype: DType
    block: int | None = None
    pack: int = 1

    def logical_shape(self, stored: tuple[Dim, ...]) -> tuple[Dim, ...]:
        """The shape of the weight the stored values encode."""
        last = stored[-1]
        return stored[:-1] + (last * self.pack if isinstance(last, int) else last,)

    def scale_types(self, stored: TensorType) -> tuple[TensorType, ...]:
        """The types of the scale tensors a weight stored as ``stored`` needs; ValueError when its
        shape does not fit the scheme."""
        if stored.rank < 1 or not isinstance(stored.shape[-1], int):
            raise ValueError(f"{self.name} needs a static last dimension, got {stored}")
        if stored.dtype != self.storage:
            raise ValueError(f"{self.name} stores {self.storage}, got {stored}")
        rows, width = stored.shape[:-1], stored.shape[-1] * self.pack
        if self.block is None:
            return (TensorType(rows, self.scale_dtype),)
        if width % self.block:
            raise ValueError(f"{self.name} scales blocks of {self.block} values; {width} values a row do not divide")
        return (TensorType(rows + (width // self.block,), self.scale_dtype),)

    def __str__(self) -> str:
        return self.name


# Scales are f32 per output channel for the 8-bit schemes; mxfp4 (OCP microscaling) packs two e2m1
# values a byte and shares one power-of-two scale (an e8m0 exponent byte) among 32 values. The block
# 8-bit schemes hold pre-quantized checkpoints exactly (kiln/compiler/sources/prequantized.py): FP8
# with 128x128 block scales (DeepSeek/Qwen FP8) as one f32 scale per row and 128 columns, GGUF Q8_0
# (an f16 scale per 32 values) as one f32 scale per 32 values of a row. A scale per row and block,
# not per block of rows, keeps fusing (row concatenation) and row/column shards exact.
SCHEMES: dict[str, QuantScheme] = {s.name: s for s in (
    QuantScheme("int8_channel", DType.i8, DType.f32),
    QuantScheme("fp8_channel", DType.f8e4m3, DType.f32),
    QuantScheme("mxfp4", DType.u8, DType.u8, block=32, pack=2),
    QuantScheme("fp8_block128", DType.f8e4m3, DType.f32, block=128),
    QuantScheme("int8_block32", DType.i8, DType.f32, block=32),
)}


# How a linear-family op treats its activations beside a quantized weight (its ``act_quant``
# attribute; unset: as they are): quantized per token (row) at run time, each by its own scale.
ACT_QUANT = ("int8_per_token", "fp8_per_token")


def get_scheme(name: str) -> QuantScheme:
    try:
        return SCHEMES[name]
    except KeyError:
        raise ValueError(f"unknown quantization scheme {name!r}; known: {', '.join(SCHEMES)}") from None


@dataclass(frozen=True)
class WeightFormat:
    """How a parameter's storage is read: plain (``scheme`` None), or quantized with ``scheme``,
    whose scales are the parameters named in ``scales``."""

    scheme: QuantScheme | None = None
    scales: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.scheme is None and self.scales:
            raise ValueError("a plain weight has no scales")

    @property
    def quantized(self) -> bool:
        return self.scheme is not None

    def __str__(self) -> str:
        if self.scheme is None:
            return "plain"
        return f"{self.scheme}({', '.join('@' + s for s in self.scales)})"

    @staticmethod
    def parse(text: str) -> WeightFormat:
        if text == "plain":
            return PLAIN
        match = re.fullmatch(r"(\w+)\((.*)\)", text)
        if not match:
            raise ValueError(f"cannot parse weight format {text!r}")
        scales = tuple(s.strip().removeprefix("@") for s in match.group(2).split(",") if s.strip())
        return WeightFormat(get_scheme(match.group(1)), scales)

    def to_json(self) -> dict[str, Any] | None:
        return None if self.scheme is None else {"scheme": self.scheme.name, "scales": list(self.scales)}

    @staticmethod
    def from_json(data: dict[str, Any] | None) -> WeightFormat:
        return PLAIN if data is None else WeightFormat(get_scheme(data["scheme"]), tuple(data["scales"]))


PLAIN = WeightFormat()


class Layout(str, Enum):
    """How ranks hold a parameter: all of it each, or a shard along an axis. ``column``: the output
    features of a column-parallel linear (its outputs are gathered); ``row``: the input features of
    a row-parallel linear (its partial outputs are summed); ``expert``: whole experts per rank;
    ``partial``: rank 0 holds all of it and the others zeros, so that a sum over the ranks adds it
    once (a row-parallel linear's bias)."""

    replicated = "replicated"
    column = "column"
    row = "row"
    expert = "expert"
    partial = "partial"


@dataclass(frozen=True)
class Placement:
    """A ``layout`` and, for a shard, the ``axis`` split across ranks."""

    layout: Layout = Layout.replicated
    axis: int | None = None

    def __post_init__(self) -> None:
        if (self.layout in (Layout.replicated, Layout.partial)) != (self.axis is None):
            need = "has no" if self.axis is not None else "needs an"
            raise ValueError(f"a {self.layout.value} placement {need} axis")
        if self.axis is not None and (isinstance(self.axis, bool) or not isinstance(self.axis, int) or self.axis < 0):
            raise ValueError(f"shard axis {self.axis!r} must be an int >= 0")

    def __str__(self) -> str:
        return self.layout.value if self.axis is None else f"{self.layout.value}({self.axis})"

    @staticmethod
    def parse(text: str) -> Placement:
        match = re.fullmatch(r"(\w+)(?:\((\d+)\))?", text)
        if not match or match.group(1) not in Layout.__members__:
            raise ValueError(f"cannot parse placement {text!r}; layouts: {', '.join(Layout.__members__)}")
        return Placement(Layout(match.group(1)), None if match.group(2) is None else int(match.group(2)))

    def to_json(self) -> dict[str, Any]:
        return {"layout": self.layout.value} if self.axis is None else {"layout": self.layout.value, "axis": self.axis}

    @staticmethod
    def from_json(data: dict[str, Any]) -> Placement:
        return Placement(Layout(data["layout"]), data.get("axis"))


REPLICATED = Placement()


@dataclass(frozen=True)
class QuantizedType(TensorType):
    """How ops see a quantized parameter: its storage type and its format. Only op inputs declared
    to take quantized weights (``OpDef.quantized``) accept one; plain parameters are TensorTypes."""

    format: WeightFormat

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.format.quantized:
            raise ValueError("a QuantizedType needs a quantized format")

    @property
    def logical_shape(self) -> tuple[Dim, ...]:
        return self.format.scheme.logical_shape(self.shape)
