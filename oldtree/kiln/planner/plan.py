"""Choosing a layout: ``make_plan(shape, request) -> Plan``, or ``PlanError`` naming why none works.

The rule, in order:
1. ``tp`` must divide the attention heads, and the KV heads must divide by ``tp`` or divide it
   (then each rank keeps one KV head, replicated); ``tp`` stays within a node (``gpus_per_node``).
2. A layout fits when, on every rank, the weights plus the requested KV (``max_seq_len`` x
   ``concurrency`` tokens) fit in ``mem_fraction`` of the GPU's memory; the rest is the reserve for
   activations, CUDA graphs and the CUDA context (kiln's engine sizes its KV pool the same way).
3. The smallest ``tp`` that fits wins, without pipeline stages. Only when no ``tp`` fits (too
   little memory, or heads that do not divide) does ``pp`` grow: 2, 3, ... stages, each with the
   smallest ``tp`` that fits.
4. MoE configs try, at each rank count n, expert parallelism inside tp first: ``tp = ep = n`` (the
   heads and the experts divide by n), then ``tp = 1, ep = n`` (attention and KV replicated on the
   n ranks, experts split: the layout when the heads do not divide), then ``tp = n`` with every
   expert on every rank (``ep`` 1, when the experts do not divide by n). A stage has max(tp, ep) ranks.
5. GPUs left over hold more replicas: ``dp = gpus // (tp x pp)`` (``kiln serve --dp``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kiln.runtime.engine_options import EngineOptions

from .hardware import MEMORY_EFFICIENCY, NVLINK_EFFICIENCY, GpuSpec, get_gpu
from .memory import Layout, StageMemory, WeightStorage, kv_heads_per_rank, stages
from .shape import ModelShape

GB = 1e9


class PlanError(ValueError):
    """No layout fits the request; ``reasons`` say why each one tried does not."""

    def __init__(self, message: str, reasons: list[str]) -> None:
        super().__init__("\n  ".join([message, *reasons]))
        self.summary = message
        self.reasons = reasons


@dataclass(frozen=True)
class PlanRequest:
    gpus: int = 1
    gpu: str = "h100"
    gpu_memory_gb: float | None = None     # default: the GPU's
    gpus_per_node: int = 8
    max_seq_len: int | None = None         # default: the model's context
    concurrency: int = 1
    dtype: str = "bf16"
    quantization: str | None = None
    mem_fraction: float = EngineOptions.mem_fraction  # weights + KV; the same default the engine sizes by

    def validate(self) -> None:
        for name in ("gpus", "gpus_per_node", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_seq_len is not None and self.max_seq_len < 1:
            raise ValueError(f"max_seq_len must be at least 1, got {self.max_seq_len}")
        if self.gpu_memory_gb is not None and self.gpu_memory_gb <= 0:
            raise ValueError(f"gpu_memory_gb must be positive, got {self.gpu_memory_gb}")
        if not 0.0 < self.mem_fraction <= 1.0:
            raise ValueError(f"mem_fraction must be in (0, 1], got {self.mem_fraction}")
        get_gpu(self.gpu)


@dataclass(frozen=True)
class Plan:
    model: str
    gpu: str
    gpu_memory_bytes: float
    gpus: int
    tp: int
    pp: int
    ep: int
    dp: int
    storage: str
    usable_bytes_per_rank: float           # mem_fraction of the GPU: weights + KV
    reserve_bytes_per_rank: float          # the rest: activations, CUDA graphs, context
    weight_bytes_per_rank: float           # the fullest stage's rank
    kv_heads_per_rank: int
    kv_bytes_per_token_per_rank: int       # the stage with the most layers
    kv_tokens: int                         # tokens of KV a replica holds after its weights
    max_seq_len: int
    concurrency: int
    requested_kv_tokens: int
    decode_bytes_per_step: float           # read by the ranks of one stage, summed over stages
    decode_step_s: float
    allreduce_bytes_per_step: float        # all-reduces a layer x layers x hidden x batch x dtype bytes
    allreduces_per_layer: int              # 2 under tp (attention, FFN), 1 under ep alone (the experts), else 0
    allreduce_s: float
    tokens_per_s: float                    # all replicas, every sequence at full context
    chosen_because: str
    assumptions: dict[str, float]          # the bandwidths, efficiencies and latency the times use
    rejected: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def layout(self) -> Layout:
        return Layout(self.tp, self.pp, self.ep)


def make_plan(shape: ModelShape, request: PlanRequest) -> Plan:
    request.validate()
    storage = WeightStorage(request.dtype, request.quantization)
    gpu = get_gpu(request.gpu)
    memory = (request.gpu_memory_gb if request.gpu_memory_gb is not None else gpu.memory_gb) * GB
    usable = memory * request.mem_fraction
    max_seq_len = request.max_seq_len or shape.max_position_embeddings
    wanted = max_seq_len * request.concurrency
    tps, rejected = _valid_tps(shape, request.gpus, request.gpus_per_node)
    for pp in range(1, min(request.gpus, shape.num_layers) + 1):
        for layout in _layouts(shape, tps, pp, min(request.gpus, request.gpus_per_node)):
            if layout.gpus > request.gpus:
                break
            per_stage = stages(shape, layout, storage)
            room = _kv_room(per_stage, usable)
            if room >= wanted:
                because = (f"{layout}: the smallest layout whose ranks hold the weights and {wanted:,} tokens of "
                           f"KV within {request.mem_fraction:.0%} of {memory / GB:g} GB")
                return _plan(shape, request, gpu, memory, usable, storage, layout, per_stage, room, max_seq_len,
                             because, rejected)
            rejected.append(f"{layout}: {_shortfall(per_stage, usable, wanted)}")
    whole = stages(shape, Layout(), storage)[0].weight_bytes
    raise PlanError(f"{shape.architecture} does not fit on {request.gpus} x {gpu.name} ({memory / GB:g} GB) "
                    f"with {wanted:,} tokens of KV ({max_seq_len} x {request.concurrency}); its weights alone "
                    f"({whole / GB:.1f} GB) need at least {math.ceil(whole / usable)} GPUs of {usable / GB:.1f} GB "
                    "usable. Layouts tried:", rejected)


def _valid_tps(shape: ModelShape, gpus: int, gpus_per_node: int) -> tuple[list[int], list[str]]:
    """The tp values rule 1 allows, ascending, and one line for each reason others are out."""
    valid, by_reason = [], {}
    for tp in range(1, min(gpus, gpus_per_node) + 1):
        if shape.num_heads % tp:
            reason = f"the {shape.num_heads} attention heads do not divide by it"
        elif shape.num_kv_heads % tp and tp % shape.num_kv_heads:
            reason = f"the {shape.num_kv_heads} KV heads neither divide by it nor divide it"
        else:
            valid.append(tp)
            continue
        by_reason.setdefault(reason, []).append(tp)
    rejected = [f"tp={'/'.join(map(str, tps))}: {reason}" for reason, tps in by_reason.items()]
    if gpus > gpus_per_node:
        rejected.append(f"tp>{gpus_per_node}: would span nodes ({gpus_per_node} GPUs a node); pp crosses nodes")
    return valid, rejected


def _layouts(shape: ModelShape, tps: list[int], pp: int, most: int) -> list[Layout]:
    """The layouts rule 1 and 4 allow with ``pp`` stages, by ranks a stage (the fewest first)."""
    if not shape.is_moe:
        return [Layout(tp, pp) for tp in tps]
    layouts = []
    for n in range(1, most + 1):
        splits = n > 1 and shape.num_experts % n == 0
        if n in tps and splits:
            layouts.append(Layout(n, pp, n))
        if splits:
            layouts.append(Layout(1, pp, n))
        if n in tps and not splits:
            layouts.append(Layout(n, pp, 1))
    return layouts


def _kv_room(per_stage: list[StageMemory], usable: float) -> int:
    """Tokens of KV every stage's ranks can hold beside their weights (the scarcest stage decides)."""
    return max(0, min(int((usable - s.weight_bytes) // s.kv_bytes_per_token) for s in per_stage))


def _shortfall(per_stage: list[StageMemory], usable: float, wanted: int) -> str:
    worst = max(per_stage, key=lambda s: s.weight_bytes)
    if worst.weight_bytes > usable:
        return f"weights {worst.weight_bytes / GB:.1f} GB a rank exceed the {usable / GB:.1f} GB usable"
    return (f"weights {worst.weight_bytes / GB:.1f} GB a rank leave room for {_kv_room(per_stage, usable):,} tokens "
            f"of KV, fewer than the {wanted:,} requested")


def _plan(shape: ModelShape, request: PlanRequest, gpu: GpuSpec, memory: float, usable: float,
          storage: WeightStorage, layout: Layout, per_stage: list[StageMemory], room: int, max_seq_len: int,
          because: str, rejected: list[str]) -> Plan:
    batch = request.concurrency
    # A routed expert is read in a step only if one of the batch's tokens picks it.
    touched = 1.0 - (1.0 - shape.experts_per_token / shape.num_experts) ** batch if shape.is_moe else 1.0
    # Every stage runs in turn for one micro-batch: the step reads each stage's weights and KV once.
    read = sum(s.weight_bytes - s.expert_bytes * (1.0 - touched) + batch * max_seq_len * s.kv_bytes_per_token
               for s in per_stage)
    # A layer's all-reduces: attention's and the FFN's under tp; under ep alone, the experts' only.
    per_layer = 2 if layout.tp > 1 else 1 if layout.ep > 1 else 0
    ranks = max(layout.tp, layout.ep)
    allreduce_bytes = per_layer * shape.num_layers * shape.hidden_size * batch * storage.dtype_bytes
    allreduce_s = 0.0
    if ranks > 1:
        ring = 2 * (ranks - 1) / ranks
        allreduce_s = (allreduce_bytes * ring / (gpu.nvlink_bandwidth * NVLINK_EFFICIENCY)
                       + per_layer * shape.num_layers * gpu.collective_latency_s)
    step = read / (gpu.memory_bandwidth * MEMORY_EFFICIENCY) + allreduce_s
    dp = request.gpus // layout.gpus
    return Plan(
        model=shape.describe(), gpu=gpu.name, gpu_memory_bytes=memory, gpus=request.gpus,
        tp=layout.tp, pp=layout.pp, ep=layout.ep, dp=dp, storage=storage.describe(),
        usable_bytes_per_rank=usable, reserve_bytes_per_rank=memory - usable,
        weight_bytes_per_rank=max(s.weight_bytes for s in per_stage),
        kv_heads_per_rank=kv_heads_per_rank(shape, layout.tp),
        kv_bytes_per_token_per_rank=max(s.kv_bytes_per_token for s in per_stage),
        kv_tokens=room, max_seq_len=max_seq_len, concurrency=batch, requested_kv_tokens=max_seq_len * batch,
        decode_bytes_per_step=read, decode_step_s=step,
        allreduce_bytes_per_step=allreduce_bytes, allreduces_per_layer=per_layer,
        allreduce_s=allreduce_s, tokens_per_s=dp * batch / step, chosen_because=because,
        assumptions={"memory_bandwidth": gpu.memory_bandwidth, "memory_efficiency": MEMORY_EFFICIENCY,
                     "nvlink_bandwidth": gpu.nvlink_bandwidth, "nvlink_efficiency": NVLINK_EFFICIENCY,
                     "collective_latency_s": gpu.collective_latency_s},
        rejected=rejected,
        notes=_notes(shape, layout, dp))


def _notes(shape: ModelShape, layout: Layout, dp: int) -> list[str]:
    from kiln.models.registry import supported_architectures

    notes = []
    if shape.num_kv_heads < layout.tp:
        notes.append(f"tp={layout.tp} exceeds the {shape.num_kv_heads} KV heads: each rank keeps one, replicated "
                     f"{layout.tp // shape.num_kv_heads} times")
    if shape.is_moe and layout.ep > 1:
        where = ("attention and KV replicated on each rank" if layout.tp == 1 else
                 f"attention tensor-parallel over the same {layout.tp} ranks")
        flags = f"--ep {layout.ep}" + (f" --tp {layout.tp}" if layout.tp > 1 else "")
        notes.append(f"MoE: ep={layout.ep}: {shape.num_experts // layout.ep} whole experts a rank, {where} "
                     f"(kiln compile/serve {flags})")
    elif shape.is_moe and layout.tp > 1:
        notes.append(f"MoE: the {shape.num_experts} experts do not divide by tp={layout.tp}: every rank holds all of "
                     "them (ep=1)")
    elif shape.architecture not in supported_architectures():
        notes.append(f"kiln cannot compile {shape.architecture} yet; supported: {', '.join(supported_architectures())}")
    if layout.pp > 1:
        notes.append(f"pp={layout.pp}: a step passes the stages in turn (the step time sums them); micro-batches in "
                     "flight overlap the stages for throughput")
    if dp > 1:
        notes.append(f"{dp} replicas of {layout.gpus} GPU(s) use the GPUs left over: kiln serve --dp {dp}")
    return notes
