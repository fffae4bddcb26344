"""Loading PEFT adapter directories: scaling (lora_alpha / r, rsLoRA), and each refusal naming its reason."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.lora_layout import LoraHook, LoraLayout, LoraSlice
from kiln.runtime.lora.adapter import AdapterError, load_adapter
from tests.support.hf_models import make_hf_model
from tests.support.lora import make_peft_adapter


def _layout(max_rank: int = 8) -> LoraLayout:
    """The layout a tiny Llama (hidden 64, intermediate 112, 4 heads, 2 KV heads) compiles to."""
    hooks = []
    for i in range(2):
        p = f"model.layers.{i}"
        hooks += [LoraHook(f"a.{i}.qkv", f"b.{i}.qkv", (LoraSlice(f"{p}.self_attn.q_proj", 64, 64),
                                                          LoraSlice(f"{p}.self_attn.k_proj", 64, 32),
                                                          LoraSlice(f"{p}.self_attn.v_proj", 64, 32))),
                  LoraHook(f"a.{i}.o", f"b.{i}.o", (LoraSlice(f"{p}.self_attn.o_proj", 64, 64),)),
                  LoraHook(f"a.{i}.gu", f"b.{i}.gu", (LoraSlice(f"{p}.mlp.gate_proj", 64, 112),
                                                        LoraSlice(f"{p}.mlp.up_proj", 64, 112))),
                  LoraHook(f"a.{i}.d", f"b.{i}.d", (LoraSlice(f"{p}.mlp.down_proj", 112, 64),))]
    return LoraLayout(2, max_rank, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                      tuple(hooks))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_hf_model("llama3", tmp_path_factory.mktemp("base") / "src")


@pytest.mark.parametrize("rslora", [False, True])
def test_weights_are_peft_s_with_the_scaling_folded_into_b(base, tmp_path, rslora):
    adapter_dir = make_peft_adapter(base, tmp_path / "a", rank=4, alpha=6.0, use_rslora=rslora)
    adapter = load_adapter(adapter_dir, _layout(), torch.float32)
    raw = load_file(str(adapter_dir / "adapter_model.safetensors"))
    scaling = 6.0 / math.sqrt(4) if rslora else 6.0 / 4
    module = "model.layers.1.self_attn.k_proj"
    a, b = adapter.weights[module]
    assert adapter.rank == 4 and len(adapter.weights) == 14
    torch.testing.assert_close(a, raw[f"base_model.model.{module}.lora_A.weight"])
    torch.testing.assert_close(b, raw[f"base_model.model.{module}.lora_B.weight"] * scaling)


def test_a_subset_of_targets_loads(base, tmp_path):
    adapter = load_adapter(make_peft_adapter(base, tmp_path / "a", targets=("q_proj", "v_proj")), _layout(), torch.float32)
    assert sorted(m.rsplit(".", 1)[1] for m in adapter.weights) == ["q_proj"] * 2 + ["v_proj"] * 2


def _edit(directory, config=None, tensors=None):
    if config:
        path = directory / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tensors:
        path = directory / "adapter_model.safetensors"
        save_file(tensors(load_file(str(path))), str(path))
    return directory


@pytest.mark.parametrize("edit,message", [
    (dict(config={"use_dora": True}), "DoRA adapters"),
    (dict(config={"target_modules": ["q_proj", "lm_head"]}), "lm_head: embedding and lm_head targets"),
    (dict(config={"modules_to_save": ["embed_tokens"]}), "embed_tokens: embedding and lm_head targets"),
    (dict(config={"r": 16}), r"rank 16 is above the maximum LoRA rank 8 \(--max-lora-rank"),
    (dict(config={"peft_type": "IA3"}), "peft_type 'IA3' is not supported"),
    (dict(config={"bias": "all"}), "LoRA biases"),
    (dict(tensors=lambda t: {k: (v[:, :40].contiguous() if "layers.0.mlp.down_proj.lora_A" in k else v) for k, v in t.items()}),
     r"shape mismatch at model.layers.0.mlp.down_proj: the adapter maps 40 -> 64 features, the base model's "
     r"model.layers.0.mlp.down_proj maps 112 -> 64"),
    (dict(tensors=lambda t: {k.replace("layers.1.", "layers.7."): v for k, v in t.items()}),
     r"adapts model.layers.7.\S+, which has no LoRA hook in this artifact"),
])
def test_refusals_name_what_is_wrong(base, tmp_path, edit, message):
    adapter_dir = _edit(make_peft_adapter(base, tmp_path / "a"), **edit)
    with pytest.raises(AdapterError, match=message):
        load_adapter(adapter_dir, _layout(), torch.float32)


def test_a_directory_without_an_adapter_is_refused(tmp_path):
    with pytest.raises(AdapterError, match="not a PEFT LoRA adapter directory"):
        load_adapter(tmp_path, _layout(), torch.float32)
