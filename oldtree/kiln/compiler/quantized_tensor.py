"""A weight that arrives already quantized (a pre-quantized checkpoint), carried through the weight recipes.

A pre-quantized checkpoint's GEMM weights are read into kiln's own formats (``sources/prequantized.py``)
as ``QuantizedTensor`` values: the stored values, their scales and the scheme. The recipes that fusing
and sharding record then work on them without dequantizing: a ``Concat`` of row blocks joins the stored
rows and the scale rows, a ``Slice`` takes rows (or whole scale blocks of columns), and the
``Quantize`` recipe passes a value already in its format through unchanged. Every kiln scheme keeps its
scales per row, which is what makes the first two exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.ir.weights import QuantScheme
from kiln.kernels.quantize import dequantize


@dataclass(frozen=True)
class QuantizedTensor:
    stored: torch.Tensor
    scales: tuple[torch.Tensor, ...]
    scheme: QuantScheme

    @property
    def shape(self) -> torch.Size:
        """The shape of the weight it encodes (what the model's parameter declares)."""
        return torch.Size(self.scheme.logical_shape(tuple(self.stored.shape)))

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.stored, self.scales, self.scheme)

    def narrow(self, axis: int, start: int, length: int) -> QuantizedTensor:
        """Rows ``start:start+length`` along ``axis``; along the last axis only whole scale blocks."""
        last = self.stored.dim() - 1
        if axis != last:
            return QuantizedTensor(self.stored.narrow(axis, start, length),
                                   tuple(s.narrow(axis, start, length) for s in self.scales), self.scheme)
        block = self.scheme.block
        if self.scheme.pack != 1 or (block is not None and (start % block or length % block)):
            raise ValueError(f"columns {start}:{start + length} of a {self.scheme} weight cut its scale blocks")
        scales = self.scales if block is None else tuple(s.narrow(axis, start // block, length // block)
                                                         for s in self.scales)
        return QuantizedTensor(self.stored.narrow(axis, start, length), scales, self.scheme)


def concat(tensors: list[torch.Tensor | QuantizedTensor], axis: int) -> torch.Tensor | QuantizedTensor:
    """``torch.cat`` of plain tensors; of quantized ones in one scheme, their stored rows and scale rows."""
    quantized = [t for t in tensors if isinstance(t, QuantizedTensor)]
    if not quantized:
        return torch.cat(tensors, dim=axis)
    schemes = {t.scheme.name for t in quantized}
    if len(quantized) != len(tensors) or len(schemes) != 1:
        kinds = ", ".join(t.scheme.name if isinstance(t, QuantizedTensor) else "plain" for t in tensors)
        raise ValueError(f"cannot join pre-quantized weights of different formats ({kinds}) into one weight")
    if axis != 0:
        raise ValueError(f"pre-quantized weights join along rows only, not axis {axis}")
    return QuantizedTensor(torch.cat([t.stored for t in quantized]),
                           tuple(torch.cat(parts) for parts in zip(*(t.scales for t in quantized))),
                           quantized[0].scheme)
