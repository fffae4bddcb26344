"""What passes share: the context they run in, with the weight recipes they leave for the artifact writer.

A pass is ``fn(graph, ctx) -> graph``. When it changes what a parameter holds (fusing q/k/v
concatenates three weights), it adds a recipe for the new parameter to ``ctx`` (``kiln.compiler.recipes``);
the weight store applies them when the artifact is written, so passes never touch tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from kiln.ir import Graph
from kiln.lora_layout import LoraLayout

from ..quantization import QuantizationMethod
from ..recipes import Recipe


@dataclass
class PassContext:
    backend: str = "torch"
    symbol_bounds: dict[str, int] = field(default_factory=dict)
    recipes: list[Recipe] = field(default_factory=list)
    quantization: QuantizationMethod | None = None  # what the quantize pass applies (None: nothing)
    quantize_lm_head: bool = False  # the quantize pass also quantizes the lm_head (a copy of a tied one)
    tp: int = 1  # tensor-parallel ranks the shard_tp pass shards for
    pp: int = 1  # pipeline stages, and the one this run of the passes compiles (split_pipeline)
    stage: int = 0
    ep: int = 1  # expert-parallel ranks the shard_ep pass partitions the experts over (inside tp: shard_ep.py)
    # Per sparse layer, the logical expert in each physical slot (place_experts.py; () for none).
    expert_placement: tuple[tuple[int, tuple[int, ...]], ...] = ()
    kv_cache_dtype: str = "auto"  # the pool's dtype (quantize_kv_cache.KV_CACHE_DTYPES; auto: the model's)
    kv_cache_scales: tuple[tuple[float, float], ...] = ()  # an FP8 pool's (k, v) scales per layer; (): 1.0
    # LoRA slots, rank and targets (None: no LoRA); insert_lora fills in its hooks for the manifest.
    lora: LoraLayout | None = None
    # Per-token outputs expose_hidden_states adds (step output names), and the layers EAGLE-3 reads.
    step_outputs: tuple[str, ...] = ()
    aux_hidden_layers: tuple[int, ...] = ()
    # Results of the analysis passes, read by codegen and the manifest.
    kernel_choice: list[str] = field(default_factory=list)
    generated_kernels: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (op, source)
    memory_plan: Any = None

    def add_recipe(self, recipe: Recipe) -> None:
        made = set(recipe.outputs).intersection(name for earlier in self.recipes for name in earlier.outputs)
        if made:
            raise ValueError(f"weight(s) {sorted(made)} are made twice")
        self.recipes.append(recipe)


Pass = Callable[[Graph, PassContext], Graph]
