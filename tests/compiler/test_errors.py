"""Bad input to ``kiln compile`` and to the artifact loader: one clear line naming the file and the
problem, exit status 2, no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.runtime.artifact import ArtifactError, load_artifact
from tests.support.hf_models import make_hf_model

REPO = Path(__file__).resolve().parents[2]


def kiln_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True, text=True, env=env)


@pytest.fixture()
def source(tmp_path):
    return make_hf_model("llama3", tmp_path / "src")


def assert_clean_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def test_unsupported_architecture_names_it_and_the_supported_ones(source, tmp_path):
    config = json.loads((source / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (source / "config.json").write_text(json.dumps(config))
    result = kiln_cli("compile", str(source), "-o", str(tmp_path / "out.kiln"))
    assert_clean_error(result, "unsupported architecture 'GPT2LMHeadModel'", "LlamaForCausalLM", "Qwen3ForCausalLM")


def test_missing_config(tmp_path):
    (tmp_path / "empty").mkdir()
    result = kiln_cli("compile", str(tmp_path / "empty"), "-o", str(tmp_path / "out.kiln"))
    assert_clean_error(result, "config.json: missing")


def test_corrupt_config(source, tmp_path):
    (source / "config.json").write_text("{not json")
    assert_clean_error(kiln_cli("compile", str(source), "-o", str(tmp_path / "o.kiln")), "config.json: not valid JSON")


def test_corrupt_safetensors(source, tmp_path):
    weights = source / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert_clean_error(kiln_cli("compile", str(source), "-o", str(tmp_path / "o.kiln")), "model.safetensors",
                       "not a readable safetensors file")


def test_missing_tensor_is_named(source, tmp_path):
    tensors = load_file(source / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, source / "model.safetensors")
    assert_clean_error(kiln_cli("compile", str(source), "-o", str(tmp_path / "o.kiln")),
                       "checkpoint lacks tensor(s) the model needs: model.layers.1.mlp.up_proj.weight")


def test_shape_mismatch_is_named(source, tmp_path):
    tensors = load_file(source / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()
    save_file(tensors, source / "model.safetensors")
    assert_clean_error(kiln_cli("compile", str(source), "-o", str(tmp_path / "o.kiln")),
                       "'model.norm.weight' has shape [63], the model needs [64]")


def test_pickle_checkpoints_are_refused(tmp_path, source):
    (source / "model.safetensors").rename(source / "pytorch_model.bin")
    assert_clean_error(kiln_cli("compile", str(source), "-o", str(tmp_path / "o.kiln")), "safetensors only")


def test_unknown_model_path(tmp_path):
    assert_clean_error(kiln_cli("compile", str(tmp_path / "nope"), "-o", str(tmp_path / "o.kiln")), "nope")


def test_refuses_to_overwrite_a_non_artifact_directory(source, tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "data.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a kiln artifact"):
        compile_model(source, precious, CompileOptions(dtype="fp32"))
    assert (precious / "data.txt").read_text() == "keep me"


def test_unknown_format_version_is_refused(source, tmp_path):
    artifact = compile_model(source, tmp_path / "a.kiln", CompileOptions(dtype="fp32", max_batch_tokens=16))
    manifest = json.loads((artifact / "manifest.json").read_text())
    manifest["format_version"] = 999
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="format version 999"):
        load_artifact(artifact)
    with pytest.raises(ArtifactError, match="not a kiln artifact"):
        load_artifact(tmp_path)


def test_invalid_compile_options(source, tmp_path):
    assert_clean_error(kiln_cli("compile", str(source), "-o", str(tmp_path / "o.kiln"), "--page-size", "0"),
                       "page_size must be >= 1")
