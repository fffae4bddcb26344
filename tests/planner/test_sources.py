"""The planner reads a model's config from every kind of name kiln takes, without its weights."""

from __future__ import annotations

import json

from kiln import compile as compile_model
from kiln.planner import ModelShape, PlanRequest, make_plan, model_config
from tests.planner.configs import LLAMA3_8B
from tests.support.hf_models import make_hf_model


def test_an_hf_directory_needs_only_its_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))  # no weights beside it
    assert model_config(tmp_path).config == LLAMA3_8B


def test_the_alias_is_read_from_the_gguf_metadata():
    # SmolLM2-135M-Instruct: 9 heads and 3 KV heads, so tp=3 is the first split past one GPU.
    shape = ModelShape.from_hf(model_config("smollm2-135m-instruct").config)
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (30, 9, 3, 64)
    assert shape.tied_embeddings
    plan = make_plan(shape, PlanRequest(gpus=4, gpu_memory_gb=0.3, max_seq_len=2048))
    assert (plan.tp, plan.pp, plan.dp) == (3, 1, 1)


def test_an_artifact_gives_its_config_and_what_it_was_compiled_with(tmp_path):
    source = make_hf_model("llama3", tmp_path / "src")
    artifact = compile_model(str(source), str(tmp_path / "m.kiln"), dtype="fp32", backend="torch", max_seq_len=128,
                             quantization="w8a16_int8")
    read = model_config(artifact)
    assert read.config == json.loads((source / "config.json").read_text())
    assert read.compiled == {"dtype": "fp32", "quantization": "w8a16_int8", "max_seq_len": 128}
