"""Bytes per rank for a layout: each pipeline stage's weights (by dtype or quantization scheme)
and its KV cache per token, as kiln's sharding lays them out.

Tensor parallelism (``tp``) splits q/k/v and gate/up by output rows and o/down by input columns;
the KV heads split across ranks, each rank keeping one when ``tp`` exceeds their count (replicated,
as ``shard_tp`` does); the embedding and lm_head split by vocabulary rows. Pipeline parallelism
(``pp``) gives each stage a run of layers (the first stages one more when they do not divide), the
embedding to the first and the lm_head to the last (a tied one is held by both). Routed experts are
whole, as kiln lays them out: ``E / ep`` of them on each of the ``ep`` expert-parallel ranks
(``shard_ep``), or all ``E`` on every rank when ``ep`` is 1 (``shard_tp`` leaves ``moe`` whole).
Expert parallelism runs inside tensor parallelism: a stage has ``max(tp, ep)`` ranks, with ``tp`` 1
(attention and KV replicated on the ``ep`` ranks) or ``ep`` dividing ``tp`` (the planner proposes
``tp == ep``; kiln also runs ``tp > ep``, each expert's width split over ``tp / ep`` ranks).

Quantization applies to every GEMM but the lm_head, as the ``quantize`` pass does; embeddings and
norms stay in the model's dtype, and so does the KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.compiler.passes import split_pipeline
from kiln.compiler.quantization import get_method
from kiln.ir.weights import QuantScheme

from .shape import ModelShape

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class WeightStorage:
    """How many bytes a weight takes: the model's dtype, or a quantization scheme for the GEMMs."""

    dtype: str = "bf16"
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.dtype!r}; supported: {', '.join(DTYPE_BYTES)}")
        if self.quantization is not None:
            get_method(self.quantization)  # names the supported methods when it is not one

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def scheme(self) -> QuantScheme | None:
        return None if self.quantization is None else get_method(self.quantization).scheme

    def gemm_bytes(self, rows: int, cols: int) -> float:
        """A GEMM weight of ``rows`` output features x ``cols`` input features, scales included."""
        scheme = self.scheme
        if scheme is None:
            return rows * cols * self.dtype_bytes
        values = rows * cols * scheme.storage.itemsize / scheme.pack
        scales = rows if scheme.block is None else rows * _ceil_div(cols, scheme.block)
        return values + scales * scheme.scale_dtype.itemsize

    def bytes_per_value(self) -> float:
        """A quantized GEMM's bytes per weight value (per-row scales over a 4096-wide row)."""
        return self.gemm_bytes(1, 4096) / 4096

    def describe(self) -> str:
        if self.quantization is None:
            return f"{self.dtype}, {self.dtype_bytes} B a value"
        return (f"GEMMs {self.quantization} ({self.scheme.name}, ~{self.bytes_per_value():.3f} B a value with "
                f"scales), the rest {self.dtype}")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def gpus(self) -> int:
        return max(self.tp, self.ep) * self.pp

    def __str__(self) -> str:
        return f"tp={self.tp} pp={self.pp}" + (f" ep={self.ep}" if self.ep > 1 else "")


@dataclass(frozen=True)
class StageMemory:
    """One rank of one pipeline stage."""

    layers: int
    weight_bytes: float
    expert_bytes: float          # the part of weight_bytes that is routed experts (0 for a dense model)
    kv_bytes_per_token: int


def kv_heads_per_rank(shape: ModelShape, tp: int) -> int:
    return max(shape.num_kv_heads // tp, 1)


def stages(shape: ModelShape, layout: Layout, storage: WeightStorage) -> list[StageMemory]:
    tp, pp = layout.tp, layout.pp
    H, D = shape.hidden_size, shape.head_dim
    heads, kv_heads = shape.num_heads // tp, kv_heads_per_rank(shape, tp)
    gemm, plain = storage.gemm_bytes, storage.dtype_bytes
    attention = gemm(heads * D, H) + 2 * gemm(kv_heads * D, H) + gemm(H, heads * D)
    ffn_width = _ceil_div(shape.intermediate_size, tp)
    dense_ffn = 2 * gemm(ffn_width, H) + gemm(H, ffn_width) if shape.intermediate_size else 0
    if not shape.is_moe:
        experts = 0.0
    elif layout.ep > 1:
        width = _ceil_div(shape.expert_intermediate_size, max(tp, layout.ep) // layout.ep)  # split at tp > ep
        experts = shape.num_experts // layout.ep * 3 * gemm(width, H)
    else:
        experts = shape.num_experts * 3 * gemm(shape.expert_intermediate_size, H)
    router = shape.num_experts * H * plain
    layer = attention + dense_ffn + experts + router + 2 * H * plain
    vocab_rows = _ceil_div(shape.vocab_size, tp) * H * plain
    kv_per_layer = 2 * kv_heads * D * plain
    result = []
    for index, count in enumerate(stage_layers(shape.num_layers, pp)):
        first, last = index == 0, index == pp - 1
        ends = (vocab_rows if first else 0) + ((vocab_rows + H * plain) if last else 0)
        if first and last and shape.tied_embeddings:
            ends -= vocab_rows  # one matrix serves as both
        result.append(StageMemory(count, count * layer + ends, count * experts, count * kv_per_layer))
    return result


def stage_layers(num_layers: int, pp: int) -> list[int]:
    """How many layers each pipeline stage holds: the compiler's split (passes/split_pipeline.py)."""
    return [len(split_pipeline.stage_layers(num_layers, pp, stage)) for stage in range(pp)]
