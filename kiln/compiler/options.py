"""Compile options: what ``kiln compile`` takes, with defaults and validation."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kiln.kernels.config import DEFAULTS, KernelConfig
from kiln.kernels.registry import BACKENDS
from kiln.step_schema import OPTIONAL_OUTPUTS, STEP_SCHEMA, StepField, StepSchema

from .passes.quantize_kv_cache import KV_CACHE_DTYPES
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
    kernel_config: KernelConfig = DEFAULTS  # the kernels' tunables, recorded in the manifest
    skip_passes: tuple[str, ...] = ()  # pipeline passes left out, for experiments (pipeline.run_pipeline)
    quantization: str | None = None  # a method of kiln.compiler.quantization.METHODS (fp8, w8a8_int8, ...)
    tp: int = 1  # tensor-parallel ranks: the artifact holds one weights file per rank (passes/shard_tp.py)
    # The KV pool's dtype: "auto" (the model's dtype) or "fp8_e4m3" (passes/quantize_kv_cache.py), and an
    # FP8 pool's calibrated per-tensor scales, a (k_scale, v_scale) pair per layer; () means 1.0 each.
    kv_cache_dtype: str = "auto"
    kv_cache_scales: tuple[tuple[float, float], ...] = ()

    def validate(self) -> None:
        for name in ("max_batch_tokens", "max_batch_size", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_seq_len is not None and self.max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {self.max_seq_len}")
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
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
        if any(len(pair) != 2 or not all(isinstance(s, (int, float)) and s > 0 for s in pair)
               for pair in self.kv_cache_scales):
            raise ValueError(f"kv_cache_scales must be (k_scale, v_scale) pairs of positive numbers, got "
                             f"{self.kv_cache_scales!r}")

    def step_schema(self) -> StepSchema:
        unknown = [name for name in self.step_outputs if name not in OPTIONAL_OUTPUTS]
        if unknown:
            raise ValueError(f"step_outputs: {', '.join(unknown)} is not a step output; supported: "
                             f"{', '.join(OPTIONAL_OUTPUTS)}")
        outputs = [OPTIONAL_OUTPUTS[name] for name in self.step_outputs]
        return STEP_SCHEMA.with_fields(*self.step_fields).with_outputs(*outputs)

    def to_json(self) -> dict:
        return {**asdict(self), "kernel_config": self.kernel_config.to_json(), "skip_passes": list(self.skip_passes)}
