"""Compiling with a quantization method: the artifact stores the quantized weights (an 8-bit one about
half the bf16 one, MXFP4 about a quarter), the manifest records the method, the program runs the
quantized kernels, and the logits stay near the unquantized model's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.artifact_format import weights_file
from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.compiler.quantization import METHODS
from kiln.runtime.artifact import load_artifact
from kiln.runtime.worker.executor import Executor
from tests.support.hf_models import make_hf_model
from tests.support.stepping import PagedRun

SMALL = dict(page_size=4, max_batch_tokens=32, max_logit_rows=32, max_seq_len=64)
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7]]
# Relative logit error bounds, about twice what this random model shows (w8a16 0.019, w8a8 0.029, fp8
# 0.116, mxfp4 0.33): one rounding moves a Gaussian weight by 0.6% (int8 per channel), 2.6% (fp8 e4m3)
# or 11.5% (mxfp4), and random layers compound it. A wrong scale or layout is off by 100% or more.
BOUNDS = {"w8a16_int8": 0.04, "w8a8_int8": 0.06, "fp8": 0.25, "mxfp4": 0.65}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """GEMM weights dominate, as in real models: a small vocabulary, wide layers, an untied lm_head."""
    return make_hf_model("llama3", tmp_path_factory.mktemp("quant") / "src", vocab_size=32, hidden_size=128,
                         intermediate_size=512)


def _compile(source: Path, out: Path, **options) -> Path:
    return compile_model(source, out, CompileOptions(**SMALL, **options))


def _weights_bytes(artifact: Path) -> int:
    return (artifact / weights_file(0)).stat().st_size


def test_quantized_artifacts_store_fewer_bytes(source, tmp_path):
    bf16 = _weights_bytes(_compile(source, tmp_path / "bf16.kiln"))
    int8 = _compile(source, tmp_path / "int8.kiln", quantization="w8a16_int8")
    assert 0.45 < _weights_bytes(int8) / bf16 < 0.6
    assert _weights_bytes(_compile(source, tmp_path / "mxfp4.kiln", quantization="mxfp4")) / bf16 < 0.3
    manifest = json.loads((int8 / "manifest.json").read_text())
    assert manifest["options"]["quantization"] == "w8a16_int8"
    assert "torch.rmsnorm_linear.int8_channel" in manifest["kernels"]
    graph = (int8 / "graph.txt").read_text()
    assert "format=int8_channel(@model.layers.0.self_attn.q_k_v_proj.weight.q.scale)" in graph
    assert "param @lm_head.weight: bf16[32, 128]" in graph  # the untied lm_head stays plain


def _logits(artifact: Path) -> torch.Tensor:
    run = PagedRun(Executor(load_artifact(artifact), "cpu"), num_pages=16)
    run.add_sequences(len(PROMPTS))
    return run.step(PROMPTS, all_logits=True)


@pytest.mark.parametrize("method", list(METHODS))
def test_each_method_runs_near_the_unquantized_logits(source, tmp_path, method):
    reference = _logits(_compile(source, tmp_path / "f32.kiln", dtype="fp32"))
    quantized = _logits(_compile(source, tmp_path / f"{method}.kiln", dtype="fp32", quantization=method))
    error = (quantized - reference).norm() / reference.norm()
    assert error < BOUNDS[method], f"{method}: relative logit error {error:.4f}"
    assert error > 0  # the weights really were quantized


def test_the_engine_compiles_with_a_quantization_and_its_lm_head(source, tmp_path, monkeypatch):
    from kiln import Engine, SamplingParams

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    with Engine(str(source), device="cpu", max_seq_len=64, kv_cache_tokens=256, quantization="mxfp4",
                quantize_lm_head=True) as engine:
        manifest = json.loads((engine.artifact_path / "manifest.json").read_text())
        assert len(engine.generate([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=4)).token_ids) == 4
    assert manifest["options"]["quantization"] == "mxfp4" and manifest["options"]["quantize_lm_head"] is True
    assert "@lm_head.weight.q: u8" in (engine.artifact_path / "graph.txt").read_text()
