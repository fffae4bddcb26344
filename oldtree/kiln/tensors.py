"""The bridge between IR dtypes and torch dtypes (the IR itself does not import torch)."""

from __future__ import annotations

import torch

from kiln.ir.types import DType

_TO_TORCH = {
    DType.f32: torch.float32, DType.f16: torch.float16, DType.bf16: torch.bfloat16,
    DType.i64: torch.int64, DType.i32: torch.int32, DType.i8: torch.int8, DType.u8: torch.uint8,
    DType.f8e4m3: torch.float8_e4m3fn,
}
_FROM_TORCH = {v: k for k, v in _TO_TORCH.items()}
_NAMES = {"fp32": DType.f32, "float32": DType.f32, "f32": DType.f32, "fp16": DType.f16, "float16": DType.f16,
          "f16": DType.f16, "half": DType.f16, "bf16": DType.bf16, "bfloat16": DType.bf16}


def torch_dtype(dtype: DType | str) -> torch.dtype:
    return _TO_TORCH[DType(dtype)]


def ir_dtype(dtype: torch.dtype) -> DType:
    try:
        return _FROM_TORCH[dtype]
    except KeyError:
        raise ValueError(f"torch dtype {dtype} has no IR dtype") from None


def parse_float_dtype(name: str) -> DType:
    """``bf16``/``bfloat16``/``fp16``/``fp32``... as the compile options spell them."""
    try:
        return _NAMES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of bf16, fp16, fp32") from None
