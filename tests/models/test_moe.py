"""The MoE model file: which layers are sparse, how experts are stacked from the checkpoint, and
the MoE variants it refuses at compile time (naming the setting and what kiln supports)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.models.moe import MoEConfig, UnsupportedMoE
from tests.compiler.test_errors import assert_clean_error, kiln_cli
from tests.support.hf_models import CONFIGS, TINY, make_hf_model

OPTIONS = CompileOptions(dtype="fp32", page_size=4, max_batch_tokens=16, max_batch_size=2, backend="torch")


def hf_config(kind: str, **overrides) -> dict:
    """The config.json a random ``kind`` model would have (no weights made)."""
    import transformers

    config_cls, model_cls, extra = CONFIGS[kind]
    config = getattr(transformers, config_cls)(**{**TINY, **extra, **overrides}, architectures=[model_cls])
    return config.to_dict()


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    cfg = MoEConfig.from_hf(hf_config("qwen2_moe", num_hidden_layers=4, decoder_sparse_step=2,
                                      mlp_only_layers=[3]))
    assert cfg.sparse_layers == {1} and cfg.shared_intermediate == 96 and not cfg.renormalize
    mixtral = MoEConfig.from_hf(hf_config("mixtral"))
    assert mixtral.sparse_layers == {0, 1} and mixtral.renormalize and mixtral.block_prefix == "block_sparse_moe"


def test_experts_are_stacked_gate_then_up(tmp_path):
    source = make_hf_model("mixtral", tmp_path / "src")
    artifact = compile_model(source, tmp_path / "m.kiln", OPTIONS)
    checkpoint = load_file(str(source / "model.safetensors"))
    weights = load_file(str(artifact / "weights" / "rank0.safetensors"))
    prefix = "model.layers.1.block_sparse_moe.experts"
    gate_up, down = weights[f"{prefix}.gate_up_proj"], weights[f"{prefix}.down_proj"]
    assert gate_up.shape == (8, 224, 64) and down.shape == (8, 64, 112)
    for e in (0, 5):
        assert torch.equal(gate_up[e], torch.cat([checkpoint[f"{prefix}.{e}.w1.weight"],
                                                  checkpoint[f"{prefix}.{e}.w3.weight"]]))
        assert torch.equal(down[e], checkpoint[f"{prefix}.{e}.w2.weight"])
    assert f"{prefix}.0.w1.weight" not in weights


@pytest.mark.parametrize("overrides, fragments", [
    # DeepSeek-V3-style routing: sigmoid scores, expert groups, its top-k method.
    (dict(scoring_func="sigmoid"), ["router setting scoring_func='sigmoid' is not supported",
                                    "softmax over the experts, top-k"]),
    (dict(n_group=8, topk_group=4), ["router setting n_group=8 is not supported", "no expert groups"]),
    (dict(topk_method="noaux_tc"), ["router setting topk_method='noaux_tc' is not supported"]),
])
def test_unsupported_router_is_refused_at_compile_time(tmp_path, overrides, fragments):
    source = make_hf_model("qwen3_moe", tmp_path / "src", **overrides)
    with pytest.raises(UnsupportedMoE) as refused:
        compile_model(source, tmp_path / "out.kiln", OPTIONS)
    for fragment in ["Qwen3MoeForCausalLM", *fragments]:
        assert fragment in str(refused.value)
    assert not (tmp_path / "out.kiln").exists()


def test_kiln_compile_refuses_an_unsupported_router_cleanly(tmp_path):
    source = make_hf_model("mixtral", tmp_path / "src", scoring_func="sigmoid")
    result = kiln_cli("compile", str(source), "-o", str(tmp_path / "out.kiln"))
    assert_clean_error(result, "MixtralForCausalLM: router setting scoring_func='sigmoid' is not supported")


def test_other_refusals():
    with pytest.raises(UnsupportedMoE, match=r"num_experts_per_tok=9 must be in 1..8"):
        MoEConfig.from_hf(hf_config("mixtral", num_experts_per_tok=9))
    with pytest.raises(UnsupportedMoE, match="use_sliding_window=true .* is not supported"):
        MoEConfig.from_hf(hf_config("qwen2_moe", use_sliding_window=True, sliding_window=8))


def test_kiln_compile_ep_refuses_experts_it_cannot_split_and_unsupported_routers(tmp_path):
    """``--ep``: an expert count ep does not divide names both; an MoE variant kiln does not run is
    refused as without ep; neither leaves an artifact behind."""
    source = make_hf_model("mixtral", tmp_path / "src")
    result = kiln_cli("compile", str(source), "-o", str(tmp_path / "out.kiln"), "--dtype", "fp32", "--ep", "3")
    assert_clean_error(result, "ep=3 must divide the experts (8 in l0.experts); possible ep: 1, 2, 4, 8")
    sigmoid = make_hf_model("qwen3_moe", tmp_path / "sigmoid", scoring_func="sigmoid")
    result = kiln_cli("compile", str(sigmoid), "-o", str(tmp_path / "out.kiln"), "--ep", "2")
    assert_clean_error(result, "Qwen3MoeForCausalLM: router setting scoring_func='sigmoid' is not supported")
    assert not (tmp_path / "out.kiln").exists()


def test_ep_on_a_dense_model_is_refused(tmp_path):
    source = make_hf_model("qwen2", tmp_path / "src")
    with pytest.raises(ValueError, match="ep=2: Qwen2ForCausalLM has no routed experts"):
        compile_model(source, tmp_path / "out.kiln", CompileOptions(dtype="fp32", ep=2, max_batch_tokens=16))
