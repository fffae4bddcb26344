"""The LoRA layout of an artifact: which GEMMs carry LoRA hooks, and the shapes of their adapter slots.

The compiler's ``insert_lora`` pass writes it (``manifest["lora"]``); the runtime reads it to size
the device slots and to check adapters against the base model. Shared by both, like
``step_schema``, so neither imports the other.

A hook sits on one GEMM of the compiled graph: a plain projection (o_proj, down_proj) or a fused one
(q/k/v, gate/up), whose output columns are the slices of its members in order. Its adapter weights
are two graph inputs, stacked over the slots (``max_loras``):

    A: [max_loras, len(slices) * max_rank, in_features]   slice i's lora_A in rows i*R .. i*R + r
    B: [max_loras, sum(out_features), max_rank]            slice i's lora_B (times its scaling) in its rows

A slot's rows past an adapter's rank, and a slice the adapter does not target, hold zeros.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The projections an adapter may target, by PEFT's module names (vLLM's and PEFT's defaults for Llama).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The step field carrying each sequence's adapter slot (-1: the base model).
SLOT_FIELD = "lora_slot"
# Token rows of one adapter tile: the hooks' kernels multiply a tile's rows at once (tl.dot's least M),
# so the step's rows are grouped by adapter in runs of this many (the ``lora_groups`` op).
TILE_ROWS = 16


@dataclass(frozen=True)
class LoraSlice:
    """One member of a hooked GEMM: its module as the checkpoint names it (``model.layers.0.self_attn.q_proj``)."""

    module: str
    in_features: int
    out_features: int


@dataclass(frozen=True)
class LoraHook:
    a_input: str   # the graph input holding the slots' stacked lora_A
    b_input: str   # ... and lora_B
    slices: tuple[LoraSlice, ...]

    @property
    def in_features(self) -> int:
        return self.slices[0].in_features

    @property
    def out_features(self) -> int:
        return sum(s.out_features for s in self.slices)

    def to_json(self) -> dict[str, Any]:
        return {"a_input": self.a_input, "b_input": self.b_input,
                "slices": [[s.module, s.in_features, s.out_features] for s in self.slices]}

    @staticmethod
    def from_json(data: dict[str, Any]) -> "LoraHook":
        return LoraHook(data["a_input"], data["b_input"], tuple(LoraSlice(*entry) for entry in data["slices"]))


@dataclass(frozen=True)
class LoraLayout:
    max_loras: int
    max_rank: int
    target_modules: tuple[str, ...]
    hooks: tuple[LoraHook, ...]

    def slice_of(self, module: str) -> tuple[LoraHook, int] | None:
        """The hook holding ``module`` and the slice's index in it, or None when no hook does."""
        for hook in self.hooks:
            for index, piece in enumerate(hook.slices):
                if piece.module == module:
                    return hook, index
        return None

    def to_json(self) -> dict[str, Any]:
        return {"max_loras": self.max_loras, "max_rank": self.max_rank, "target_modules": list(self.target_modules),
                "hooks": [h.to_json() for h in self.hooks]}

    @staticmethod
    def from_json(data: dict[str, Any]) -> "LoraLayout":
        return LoraLayout(data["max_loras"], data["max_rank"], tuple(data["target_modules"]),
                          tuple(LoraHook.from_json(h) for h in data["hooks"]))
