"""Random EAGLE draft heads written in their published checkpoint layouts (safetensors), and a plain
torch reference of their forward pass (SGLang's llama_eagle.py / llama_eagle3.py, written out), for
tests: the heads fit the tiny target models of ``hf_models`` (hidden 64, vocabulary 320)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from .hf_models import TINY

DRAFT_CONFIG = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
                    vocab_size=TINY["vocab_size"], hidden_act="silu", tie_word_embeddings=False)
DRAFT_VOCAB = 96  # EAGLE-3's draft vocabulary: a subset of the target's 320 tokens


def write_eagle_head(directory: Path, version: str, seed: int = 0, hidden: int = 64,
                     vocab: int = TINY["vocab_size"]) -> Path:
    """An EAGLE (``version`` "eagle": SafeAILab's names, ``fc`` with a bias, no embedding or head) or
    EAGLE-3 head (``midlayer.*``, ``norm``, its own ``lm_head`` over ``DRAFT_VOCAB`` tokens, ``d2t``
    and ``t2d``) with random weights."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.08

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(hidden, generator=gen)

    heads, kv, d, inter = 4, 2, hidden // 4, DRAFT_CONFIG["intermediate_size"]
    prefix = "midlayer" if version == "eagle3" else "layers.0"
    attn_in = 2 * hidden if version == "eagle3" else hidden
    tensors = {
        f"{prefix}.self_attn.q_proj.weight": rand(heads * d, attn_in),
        f"{prefix}.self_attn.k_proj.weight": rand(kv * d, attn_in),
        f"{prefix}.self_attn.v_proj.weight": rand(kv * d, attn_in),
        f"{prefix}.self_attn.o_proj.weight": rand(hidden, heads * d),
        f"{prefix}.post_attention_layernorm.weight": norm(),
        f"{prefix}.mlp.gate_proj.weight": rand(inter, hidden),
        f"{prefix}.mlp.up_proj.weight": rand(inter, hidden),
        f"{prefix}.mlp.down_proj.weight": rand(hidden, inter),
    }
    config = dict(DRAFT_CONFIG, hidden_size=hidden, vocab_size=vocab)
    if version == "eagle3":
        hot = torch.randperm(vocab, generator=gen)[:DRAFT_VOCAB].sort().values
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[hot] = True
        tensors.update({"fc.weight": rand(hidden, 3 * 64), f"{prefix}.input_layernorm.weight": norm(),
                        f"{prefix}.hidden_norm.weight": norm(), "norm.weight": norm(),
                        "lm_head.weight": rand(DRAFT_VOCAB, hidden), "d2t": hot - torch.arange(DRAFT_VOCAB), "t2d": t2d})
        config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=DRAFT_VOCAB, target_hidden_size=64)
    else:
        tensors.update({"fc.weight": rand(hidden, 2 * hidden), "fc.bias": rand(hidden)})
        config.update(architectures=["LlamaForCausalLM"], bias=True)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def reference_draft(version: str, weights: dict[str, torch.Tensor], ids: torch.Tensor, hidden_in: torch.Tensor,
                    positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits in the draft's vocabulary, pre-norm hidden states) of one sequence's rows, every row
    attending to those before it. ``weights`` by the draft graph's names (embedding and head included);
    ``hidden_in``: the target's features (EAGLE-3: the three layers side by side)."""
    eps = DRAFT_CONFIG["rms_norm_eps"]

    def rms(x, w):
        return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    embeds = weights["embed_tokens.weight"][ids]
    if version == "eagle3":
        p = "midlayer"
        residual = hidden_in @ weights["fc.weight"].T
        x = torch.cat([rms(embeds, weights[f"{p}.input_layernorm.weight"]),
                       rms(residual, weights[f"{p}.hidden_norm.weight"])], dim=1)
    else:
        p = "layers.0"
        residual = x = torch.cat([embeds, hidden_in], dim=1) @ weights["fc.weight"].T + weights["fc.bias"]
    hidden = residual + _attention(x, weights, f"{p}.self_attn", positions)
    h = rms(hidden, weights[f"{p}.post_attention_layernorm.weight"])
    hidden = hidden + (F.silu(h @ weights[f"{p}.mlp.gate_proj.weight"].T) * (h @ weights[f"{p}.mlp.up_proj.weight"].T)) \
        @ weights[f"{p}.mlp.down_proj.weight"].T
    head_in = rms(hidden, weights["norm.weight"]) if version == "eagle3" else hidden
    return head_in @ weights["lm_head.weight"].T, hidden


def _attention(x: torch.Tensor, weights: dict[str, torch.Tensor], prefix: str, positions: torch.Tensor) -> torch.Tensor:
    heads, kv = DRAFT_CONFIG["num_attention_heads"], DRAFT_CONFIG["num_key_value_heads"]
    q = (x @ weights[f"{prefix}.q_proj.weight"].T).view(len(x), heads, -1)
    k = (x @ weights[f"{prefix}.k_proj.weight"].T).view(len(x), kv, -1)
    v = (x @ weights[f"{prefix}.v_proj.weight"].T).view(len(x), kv, -1)
    d = q.shape[-1]
    inv_freq = 1.0 / DRAFT_CONFIG["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions.float()[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]

    def rotate(t):
        return t * cos + torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1) * sin

    q, k = rotate(q), rotate(k)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * d ** -0.5
    scores = scores.masked_fill(torch.ones(len(x), len(x), dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(len(x), -1)
    return out @ weights[f"{prefix}.o_proj.weight"].T
