"""Compile options: what ``kiln compile`` takes, with defaults and validation."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kiln.kernels.config import DEFAULTS, KernelConfig
from kiln.kernels.registry import BACKENDS
from kiln.lora_layout import SLOT_FIELD, TARGET_MODULES, LoraLayout
from kiln.step_schema import OPTIONAL_OUTPUTS, SEQUENCE, STEP_SCHEMA, TREE_MASK, StepField, StepSchema

from .passes.quantize_kv_cache import KV_CACHE_DTYPES
from .passes.shard_ep import check_ep
from .pipeline import selected_passes
from .quantization import get_method


@dataclass(frozen=True)
class CompileOptions:
    dtype: str = "bf16"
    backend: str = "torch"
    max_batch_tokens: int = 2048      # T: tokens in one step (prefill chunks + decodes)
    max_batch_size: int = 256         # B: sequences in one step
    max_seq_len: int | None = None    # context length; default: the model's max positions
    max_logit_rows: int | None = None  # N: rows of logits one step returns; default max_batch_size
    page_size: int = 16
    # Per-step inputs beyond the default schema's (kiln.step_schema), for features that read more.
    step_fields: tuple[StepField, ...] = ()
    # Outputs beyond the logits each step returns, by name (kiln.step_schema.OPTIONAL_OUTPUTS).
    step_outputs: tuple[str, ...] = ()
    # The layers whose input ``aux_hidden_states`` (EAGLE-3's draft input) holds; (): SGLang's default
    # (passes/expose_hidden_states.default_aux_layers).
    aux_hidden_layers: tuple[int, ...] = ()
    # Draft-tree verification: a ``tree_mask`` step input every attention reads (passes/tree_attention.py).
    tree_attention: bool = False
    kernel_config: KernelConfig = DEFAULTS  # the kernels' tunables, recorded in the manifest
    skip_passes: tuple[str, ...] = ()  # pipeline passes left out, for experiments (pipeline.run_pipeline)
    quantization: str | None = None  # a method of kiln.compiler.quantization.METHODS (fp8, w8a8_int8, ...)
    # The lm_head quantized too, by the same method (passes/quantize.py; plain by default).
    quantize_lm_head: bool = False
    tp: int = 1  # tensor-parallel ranks: the artifact holds one weights file per rank (passes/shard_tp.py)
    # Pipeline stages, each holding its share of the layers on tp ranks of its own (passes/split_pipeline.py).
    pp: int = 1
    # Expert-parallel ranks: the routed experts partitioned over them, inside tp (passes/shard_ep.py:
    # tp 1, or ep dividing tp); a stage runs on max(tp, ep) ranks.
    ep: int = 1
    # Redundant experts: (layer, the logical expert in each physical slot) per sparse layer that has
    # copies (passes/place_experts.py; compiler/expert_placement.py makes them from measured loads).
    expert_placement: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # The KV pool's dtype: "auto" (the model's dtype) or "fp8_e4m3" (passes/quantize_kv_cache.py), and an
    # FP8 pool's calibrated per-tensor scales, a (k_scale, v_scale) pair per layer; () means 1.0 each.
    kv_cache_dtype: str = "auto"
    kv_cache_scales: tuple[tuple[float, float], ...] = ()
    # Multi-LoRA (passes/insert_lora.py): adapter slots on the device (0: no LoRA hooks), the largest
    # adapter rank they hold, and the projections that get hooks (PEFT's module names).
    max_loras: int = 0
    max_lora_rank: int = 16
    lora_target_modules: tuple[str, ...] = TARGET_MODULES

    def validate(self) -> None:
        for name in ("max_batch_tokens", "max_batch_size", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_seq_len is not None and self.max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {self.max_seq_len}")
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if self.pp < 1:
            raise ValueError(f"pp must be >= 1, got {self.pp}")
        if self.pp > 1 and self.step_outputs:
            raise ValueError(f"step_outputs {', '.join(self.step_outputs)}: a pipelined artifact (pp={self.pp}) "
                             f"returns the logits only")
        check_ep(self.ep, self.tp)
        if self.ep > 1 and self.pp > 1:
            raise ValueError(f"ep={self.ep} with pp={self.pp} is not supported: expert parallelism runs on one "
                             f"pipeline stage (pp=1), alone or inside tensor parallelism")
        if any(not (isinstance(layer, int) and layer >= 0 and slots and all(isinstance(e, int) for e in slots))
               for layer, slots in self.expert_placement):
            raise ValueError(f"expert_placement must be (layer, (expert per slot, ...)) pairs, got "
                             f"{self.expert_placement!r}")
        if self.max_logit_rows is not None and self.max_logit_rows < 1:
            raise ValueError(f"max_logit_rows must be >= 1, got {self.max_logit_rows}")
        self.step_schema()
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not isinstance(self.kernel_config, KernelConfig):
            raise ValueError(f"kernel_config must be a KernelConfig, got {type(self.kernel_config).__name__}")
        selected_passes(self.skip_passes)
        if self.quantization is not None:
            get_method(self.quantization)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported; supported: "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        if self.kv_cache_scales and self.kv_cache_dtype == "auto":
            raise ValueError("kv_cache_scales are the scales of an FP8 KV cache; give kv_cache_dtype='fp8_e4m3' too")
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras must be >= 0 and max_lora_rank >= 1, got {self.max_loras} and "
                             f"{self.max_lora_rank}")
        unknown = sorted(set(self.lora_target_modules) - set(TARGET_MODULES))
        if unknown or not self.lora_target_modules:
            raise ValueError(f"lora_target_modules: {', '.join(unknown) or 'none given'}; supported: "
                             f"{', '.join(TARGET_MODULES)}")
        if self.max_loras and self.tp > 1:
            raise ValueError("LoRA (max_loras > 0) with tensor parallelism (tp > 1) is not supported yet; use tp=1")
        if any(len(pair) != 2 or not all(isinstance(s, (int, float)) and s > 0 for s in pair)
               for pair in self.kv_cache_scales):
            raise ValueError(f"kv_cache_scales must be (k_scale, v_scale) pairs of positive numbers, got "
                             f"{self.kv_cache_scales!r}")

    @property
    def stage_ranks(self) -> int:
        """The ranks of one pipeline stage: its tensor- and expert-parallel shards."""
        return max(self.tp, self.ep)

    @property
    def ranks(self) -> int:
        """The ranks the artifact runs on: one weights file each."""
        return self.stage_ranks * self.pp

    def step_schema(self) -> StepSchema:
        unknown = [name for name in self.step_outputs if name not in OPTIONAL_OUTPUTS]
        if unknown:
            raise ValueError(f"step_outputs: {', '.join(unknown)} is not a step output; supported: "
                             f"{', '.join(OPTIONAL_OUTPUTS)}")
        outputs = [OPTIONAL_OUTPUTS[name] for name in self.step_outputs]
        fields = self.step_fields
        if self.tree_attention:
            fields += (TREE_MASK,)
        if self.max_loras:
            fields += (StepField(SLOT_FIELD, SEQUENCE, -1, "each sequence's LoRA adapter slot (-1: the base model)"),)
        return STEP_SCHEMA.with_fields(*fields).with_outputs(*outputs)

    def lora_layout(self) -> LoraLayout | None:
        """What insert_lora hooks (its hooks filled in by the pass), or None without LoRA."""
        if not self.max_loras:
            return None
        return LoraLayout(self.max_loras, self.max_lora_rank, tuple(self.lora_target_modules), ())

    def to_json(self) -> dict:
        return {**asdict(self), "kernel_config": self.kernel_config.to_json(), "skip_passes": list(self.skip_passes),
                "lora_target_modules": list(self.lora_target_modules)}
