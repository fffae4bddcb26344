"""Small random-weight HF checkpoints of every supported architecture, saved with save_pretrained."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)

CONFIGS = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    "smollm2": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=100000.0, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(rope_theta=10000.0, sliding_window=None)),
    "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(rope_theta=10000.0, sliding_window=5)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1000000.0, tie_word_embeddings=False)),
    "qwen2_yarn": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        rope_theta=1000000.0, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(rope_theta=1000000.0, head_dim=32, tie_word_embeddings=True)),
    # Mixture of experts: top-2 of 8 (renormalized), with and without the sliding window; Qwen2-MoE's
    # top-4 of 8 unnormalized with its gated shared expert, layer 0 dense (mlp_only_layers); Qwen3-MoE's
    # normalized top-3 of 8 with q/k norm.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        rope_theta=1000000.0, num_local_experts=8, num_experts_per_tok=2, sliding_window=None)),
    "mixtral_window": ("MixtralConfig", "MixtralForCausalLM", dict(
        rope_theta=1000000.0, num_local_experts=8, num_experts_per_tok=2, sliding_window=5)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        rope_theta=1000000.0, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=48,
        shared_expert_intermediate_size=96, norm_topk_prob=False, mlp_only_layers=[0])),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        rope_theta=1000000.0, head_dim=32, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48,
        norm_topk_prob=True)),
}


def make_hf_model(kind: str, directory: Path, seed: int = 0, **overrides) -> Path:
    """Writes a random-weight model of ``kind`` (a key of CONFIGS) into ``directory``."""
    import transformers

    config_cls, model_cls, extra = CONFIGS[kind]
    config = getattr(transformers, config_cls)(**{**TINY, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():
        # Default init is tiny; widen it so logits differ clearly between tokens.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(directory)
    return directory


def load_hf(directory: Path, dtype: torch.dtype = torch.float32):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    return model.eval()


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """HF's greedy continuation of ``prompt``, never stopping at EOS (kiln's ``ignore_eos``): a plain
    argmax loop over the KV cache, so no generation-config rule (EOS, min length) interferes."""
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model(torch.tensor([prompt], device=device), use_cache=True)
        tokens = []
        for _ in range(new_tokens):
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            out = model(torch.tensor([[token]], device=device), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def make_tokenized_model(kind: str, directory: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """A random ``kind`` model in ``tokenizer_dir``'s vocabulary (49152 tokens: SmolLM2's), with its
    tokenizer files and chat template beside the weights: one ``kiln serve`` can answer text with."""
    import shutil

    make_hf_model(kind, directory, seed, **{"vocab_size": 49152, **overrides})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(tokenizer_dir / name, directory / name)
    return directory
