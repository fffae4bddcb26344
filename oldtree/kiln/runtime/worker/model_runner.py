"""The model runner: one scheduled batch in, logits and sampled tokens out.

It owns the executor (program, its rank's weights, arena), the KV pool (its rank's KV heads) and the
step graphs, turns the scheduler's index lists into step tensors on the device (decode steps go
through the decode graphs, other steps through the prefill graphs when they fit), and runs the
sampler on the logits rows.
"""

from __future__ import annotations

import torch

from ..artifact import Artifact
from kiln.lora_layout import LoraLayout
from kiln.tensors import torch_dtype

from ..kvcache.pool import KVPool, pool_dtype
from ..lora.slots import LoraSlots
from ..sampling import SamplerKernels, SamplerOutput, SamplingBatch, sample
from ..scheduler.batch import StepLists
from ..startup import StartupTimer
from .decode_graphs import DecodeGraphs
from .executor import Executor, StepInputs, StepResult
from .expert_load import ExpertLoad
from .prefill_graphs import PrefillGraphs

class ModelRunner:
    def __init__(self, artifact: Artifact, device: torch.device | str, num_pages: int,
                 decode_buckets: tuple[int, ...] = (), prefill_graphs: bool = False, rank: int = 0,
                 reference_fallback: bool = False, verify_tokens: int = 1, startup: StartupTimer | None = None) -> None:
        """``startup`` times the loading phases (weights, kernels, KV pool, graph capture)."""
        startup = startup or StartupTimer("engine")
        rt = artifact.runtime
        self.device = torch.device(device)
        self.executor = Executor(artifact, self.device, rank, reference_fallback, startup)
        self.sampler_kernels = SamplerKernels.for_device(self.device, artifact.kernel_config)
        self.page_size: int = rt["page_size"]
        self.vocab_size: int = rt["vocab_size"]
        layers = artifact.layers  # a pipeline stage's pool holds its own layers only
        with startup.phase("kv_pool"):
            self.pool = KVPool(len(layers), rt["num_kv_heads"], rt["head_dim"], pool_dtype(rt),
                               self.device, num_pages, self.page_size, layers.start)
        self.expert_load = ExpertLoad(rt.get("expert_load", []), self.device)
        # LoRA artifacts: the adapter slots' buffers, graph inputs the program reads beside the pool's
        # views (the registry writes adapters into them; graphs see the writes at replay).
        lora = artifact.manifest.get("lora")
        self.lora_slots = LoraSlots(LoraLayout.from_json(lora), torch_dtype(rt["dtype"]), self.device) if lora else None
        # The state every step reads and updates in place: the KV pool's layer views, the expert
        # counters and the adapter slots.
        self.kv_views = {**self.pool.layer_views(), **self.expert_load.views(),
                         **(self.lora_slots.buffers if self.lora_slots is not None else {})}
        bounds = rt["symbol_bounds"]
        buckets = [b for b in decode_buckets if b <= min(bounds["T"], bounds["B"], bounds["N"])]
        self.decode_graphs = DecodeGraphs(self.executor, self.kv_views, buckets, bounds["P"],
                                          startup=startup) if buckets else None
        self.prefill_graphs = PrefillGraphs(self.executor, self.kv_views, bounds) if prefill_graphs else None
        # Speculative verify steps where every sequence brings verify_tokens tokens (drafts padded to
        # a full chain): decode graphs of that many tokens a sequence, for the buckets that fit.
        k = verify_tokens
        verify_buckets = [b for b in buckets if k * b <= min(bounds["T"], bounds["N"])]
        self.verify_graphs = DecodeGraphs(self.executor, self.kv_views, verify_buckets, bounds["P"],
                                          tokens_per_sequence=k) if k > 1 and verify_buckets else None

    def forward(self, lists: StepLists, tokens_from: torch.Tensor | None = None) -> StepResult:
        """The step's outputs (logits ``[len(lists.logits_index), V]`` in f32, and any other the
        artifact's step schema declares) and, for decode steps run as graphs, their greedy tokens;
        views valid until the next step. ``tokens_from``: see DecodeGraphs.run (only graph steps
        take their input ids from the device)."""
        if self.decode_graphs is not None and self.decode_graphs.fits(lists):
            return self.decode_graphs.run(lists, tokens_from)
        if tokens_from is not None:
            raise ValueError("input ids from the device need a decode-graph step")
        if self.verify_graphs is not None and self.verify_graphs.fits(lists):
            return self.verify_graphs.run(lists)
        if self.prefill_graphs is not None and self.prefill_graphs.fits(lists):
            return self.prefill_graphs.run(lists)
        return self.forward_eager(lists)

    def host_mirror(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """Host memory the step that made ``tokens`` also wrote them to, if any (see DecodeGraphs)."""
        return self.decode_graphs.host_mirror(tokens) if self.decode_graphs is not None else None

    def forward_eager(self, lists: StepLists, extra_feeds: dict[str, torch.Tensor] | None = None) -> StepResult:
        """The step run op by op, never through a graph, on tensors exactly the step's size.
        ``extra_feeds``: graph inputs beyond the step schema's (a draft head's hidden states)."""
        schema = self.executor.schema
        sizes = {axis: len(lists.column(name)) for axis, name in schema.size_fields().items()}
        feeds = {}
        for field in schema:
            values = lists.column(field.name)
            if field.columns is None:
                pad = field.pad_value(sizes["T"])
                feeds[field.name] = self._ints(values if values is not None else [pad] * sizes[field.axis])
                continue
            rows = values if values is not None else [[]] * sizes[field.axis]
            width = max(1, max(map(len, rows), default=0))
            table = torch.full((len(rows), width), field.pad_value(sizes["T"]), dtype=torch.int32)
            for i, row in enumerate(rows):
                table[i, :len(row)] = torch.tensor(row, dtype=torch.int32)
            feeds[field.name] = table.to(self.device, non_blocking=True)
        feeds.update(extra_feeds or {})
        inputs = StepInputs(feeds, max_q_len=max(lists.q_len), max_kv_len=max(lists.kv_len))
        return StepResult(self.executor.run(inputs, self.kv_views), None)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch, allowed: torch.Tensor | None = None) -> SamplerOutput:
        return sample(logits, batch, allowed, self.sampler_kernels)

    def _ints(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32).to(self.device, non_blocking=True)
