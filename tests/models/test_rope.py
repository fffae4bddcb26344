"""Rope tables equal HF's inverse frequencies and attention factors, in both config layouts."""

import math

import pytest
import torch

from kiln.models.rope import RopeConfig, cos_sin_table, inverse_frequencies

CASES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_inverse_frequencies_match_transformers(name):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {**CASES[name], "rope_theta": 500000.0}
    hf_config = LlamaConfig(hidden_size=512, num_attention_heads=4, max_position_embeddings=8192,
                            rope_parameters=params)
    if name == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        expected, factor = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_config)
    else:
        expected, factor = ROPE_INIT_FUNCTIONS[name](hf_config, "cpu")
    ours, our_factor = inverse_frequencies(RopeConfig.from_hf(hf_config.to_dict(), head_dim=128))
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)
    assert our_factor == pytest.approx(factor)


def test_legacy_layout_equals_transformers5_layout():
    legacy = {"rope_theta": 500000.0, "max_position_embeddings": 8192,
              "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}}
    modern = {"max_position_embeddings": 8192,
              "rope_parameters": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 1024}}
    assert torch.equal(cos_sin_table(RopeConfig.from_hf(legacy, 64), 100),
                       cos_sin_table(RopeConfig.from_hf(modern, 64), 100))


def test_table_layout_is_cos_then_sin():
    rope = RopeConfig.from_hf({"rope_theta": 10000.0, "max_position_embeddings": 16}, 8)
    table = cos_sin_table(rope, 16)
    assert table.shape == (16, 8)
    assert table[5, 1].item() == pytest.approx(math.cos(5 * 10000 ** (-2 / 8)), rel=1e-6)
    assert table[5, 5].item() == pytest.approx(math.sin(5 * 10000 ** (-2 / 8)), rel=1e-6)


def test_unsupported_rope_type_is_named():
    with pytest.raises(ValueError, match="'longrope' is not supported; supported: default, linear, llama3, yarn"):
        RopeConfig.from_hf({"rope_scaling": {"rope_type": "longrope"}, "max_position_embeddings": 16}, 8)
