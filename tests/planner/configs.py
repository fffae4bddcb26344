"""HF ``config.json`` dicts of known model shapes (no hub: the numbers from the published configs)."""

from __future__ import annotations

from typing import Any


def llama(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int = 128256,
          **extra: Any) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "intermediate_size": intermediate,
            "vocab_size": vocab, "max_position_embeddings": 8192, "tie_word_embeddings": False, **extra}


LLAMA3_8B = llama(4096, 32, 32, 8, 14336)
LLAMA3_70B = llama(8192, 80, 64, 8, 28672)
LLAMA31_405B = llama(16384, 126, 128, 8, 53248)
MIXTRAL_8X7B = {**llama(4096, 32, 32, 8, 14336, vocab=32000), "architectures": ["MixtralForCausalLM"],
                "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 32768}
# 70B-sized, with 63 heads (head_dim 128): no tp in 2..8 divides them.
ODD_HEADS_70B = llama(8064, 80, 63, 9, 28672)
