"""``ModelShape``: the dimensions of a decoder-only transformer that decide its memory and traffic.

Read from an HF ``config.json`` dict, including configs kiln cannot run yet: a planner answers
"how many GPUs would this need" before anyone compiles. Mixture-of-experts configs are recognised
by ``num_local_experts`` (Mixtral) or ``num_experts`` (Qwen-MoE); their expert FFN width is
``moe_intermediate_size`` where given, and a shared expert (``shared_expert_intermediate_size``)
counts as one more dense FFN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


@dataclass(frozen=True)
class ModelShape:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int       # the dense FFN width (0 for an MoE layer without a shared expert)
    vocab_size: int
    tied_embeddings: bool
    max_position_embeddings: int
    num_experts: int = 0         # 0: a dense model
    experts_per_token: int = 0
    expert_intermediate_size: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @staticmethod
    def from_hf(config: Mapping[str, Any]) -> "ModelShape":
        missing = [key for key in REQUIRED_KEYS if key not in config]
        if missing:
            raise ValueError(f"the model config lacks {', '.join(missing)}; a plan needs {', '.join(REQUIRED_KEYS)}")
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
        dense_width = int(config["intermediate_size"])
        if experts:
            # The routed experts replace the dense FFN; a shared expert, where present, is a dense FFN beside them.
            expert_width = int(config.get("moe_intermediate_size") or dense_width)
            dense_width = int(config.get("shared_expert_intermediate_size") or 0)
        else:
            expert_width = 0
        return ModelShape(
            architecture=(config.get("architectures") or ["unknown"])[0],
            hidden_size=hidden,
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=dense_width,
            vocab_size=int(config["vocab_size"]),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
            num_experts=experts,
            experts_per_token=int(config.get("num_experts_per_tok") or 0) if experts else 0,
            expert_intermediate_size=expert_width,
        )

    def parameter_count(self) -> int:
        """All parameters (norms and GEMMs; biases left out: under 0.01% of any real model)."""
        H, D = self.hidden_size, self.head_dim
        attention = H * (self.num_heads * D) * 2 + H * (self.num_kv_heads * D) * 2
        ffn = 3 * H * self.intermediate_size + self.num_experts * (3 * H * self.expert_intermediate_size + H)
        embeddings = self.vocab_size * H * (1 if self.tied_embeddings else 2)
        return self.num_layers * (attention + ffn + 2 * H) + embeddings + H

    def describe(self) -> str:
        experts = (f", {self.num_experts} experts ({self.experts_per_token} a token)" if self.is_moe else "")
        return (f"{self.architecture}: {self.parameter_count() / 1e9:.2f}B parameters, {self.num_layers} layers, "
                f"hidden {self.hidden_size}, {self.num_heads} heads / {self.num_kv_heads} KV heads of "
                f"{self.head_dim}, vocab {self.vocab_size}{experts}")
