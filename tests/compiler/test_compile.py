"""The compile pipeline end to end: artifact layout, a fresh process reproducing the logits, and the
runtime loading an artifact without importing the compiler."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kiln.artifact_format import FORMAT_VERSION
from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.compiler.pipeline import PIPELINE
from kiln.runtime.artifact import load_artifact
from kiln.runtime.worker.executor import Executor
from tests.support.hf_models import make_hf_model
from tests.support.stepping import PagedRun

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7]]

RUN_IN_FRESH_PROCESS = textwrap.dedent("""
    import sys, torch
    from kiln.runtime.artifact import load_artifact
    from kiln.runtime.worker.executor import Executor
    from tests.support.stepping import PagedRun
    run = PagedRun(Executor(load_artifact(sys.argv[1]), "cpu"), num_pages=64)
    run.add_sequences(2)
    torch.save(run.step([[1, 2, 3, 4, 5], [9, 8, 7]], all_logits=True), sys.argv[2])
    assert not [m for m in sys.modules if m.startswith("kiln.compiler")], "runtime imported the compiler"
""")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compile")
    source = make_hf_model("qwen2", tmp / "src")
    return compile_model(source, tmp / "qwen2.kiln", CompileOptions(dtype="fp32", page_size=4, max_batch_tokens=32,
                                                                    max_logit_rows=32), dump_ir=tmp / "ir")


def test_artifact_layout_and_manifest(artifact):
    for name in ("manifest.json", "graph.txt", "graph.json", "program.py", "weights/rank0.safetensors"):
        assert (artifact / name).is_file(), name
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["format_version"] == FORMAT_VERSION
    assert manifest["model"]["architecture"] == "Qwen2ForCausalLM"
    assert manifest["options"]["page_size"] == 4
    assert [entry["pass"] for entry in manifest["passes"]] == [name for name, _ in PIPELINE]
    assert all(entry["seconds"] >= 0 for entry in manifest["passes"])
    graph_text = (artifact / "graph.txt").read_text()
    assert "q_k_v_proj" in graph_text and "silu_mul_linear_residual" in graph_text and "linear_residual" in graph_text
    assert ".q_proj" not in graph_text


def test_the_residual_stream_is_one_buffer_written_in_place(artifact):
    plan = json.loads((artifact / "manifest.json").read_text())["memory_plan"]
    residuals = [name for name in plan["roots"] if ".resid_" in name]
    assert len(residuals) >= 4 and len({plan["roots"][name] for name in residuals}) == 1
    program = (artifact / "program.py").read_text()
    assert program.count("# in place of") == len(residuals)


def test_fused_weights_are_their_sources_joined_byte_for_byte(tmp_path):
    """What the recipes make is what the compiler wrote before they existed: each fused weight (and
    bias) the members' checkpoint tensors concatenated row-wise, then cast; every other weight its
    checkpoint tensor, cast."""
    from safetensors.torch import load_file

    from kiln.compiler.sources.hf import load_hf_dir

    source = load_hf_dir(make_hf_model("qwen2", tmp_path / "src"))
    artifact = compile_model(source, tmp_path / "bf16.kiln", CompileOptions(dtype="bf16", max_batch_tokens=32))
    written = load_file(str(artifact / "weights/rank0.safetensors"))
    fused = {"q_k_v_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    for name, tensor in written.items():
        if name == "rope.cos_sin":
            continue
        fusion = next((f for f in fused if f".{f}." in name), None)
        parts = [name.replace(fusion, member) for member in fused[fusion]] if fusion else [name]
        expected = torch.cat([source.tensors.get(p) for p in parts]).to(torch.bfloat16)
        assert tensor.dtype == expected.dtype, name
        assert torch.equal(tensor.view(torch.int16), expected.view(torch.int16)), name
    assert sum(f".{f}." in name for name in written for f in fused) == 2 * 3  # a layer: q/k/v weight and bias, gate/up


def test_dump_ir_writes_each_pass(artifact):
    dumped = sorted(p.name for p in (artifact.parent / "ir").iterdir())
    assert dumped[0] == "00_input.txt" and len(dumped) == len(PIPELINE) + 1


def test_fresh_process_gives_same_logits_without_importing_compiler(artifact, tmp_path):
    run = PagedRun(Executor(load_artifact(artifact), "cpu"), num_pages=64)
    run.add_sequences(2)
    expected = run.step(PROMPTS, all_logits=True)
    out = tmp_path / "logits.pt"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", RUN_IN_FRESH_PROCESS, str(artifact), str(out)], check=True, env=env,
                   cwd=tmp_path)
    assert torch.equal(torch.load(out), expected)


def test_bf16_compile_runs_and_stays_close(tmp_path):
    source = make_hf_model("llama3", tmp_path / "src")
    results = {}
    for dtype in ("fp32", "bf16"):
        art = compile_model(source, tmp_path / f"{dtype}.kiln", CompileOptions(dtype=dtype, max_batch_tokens=32))
        run = PagedRun(Executor(load_artifact(art), "cpu"), num_pages=64)
        run.add_sequences(2)
        results[dtype] = run.step(PROMPTS)
    assert results["bf16"].dtype == torch.float32
    assert (results["bf16"] - results["fp32"]).abs().max().item() < 0.1


def test_triton_artifact_falls_back_to_torch_on_a_cpu_without_the_interpreter(tmp_path):
    # `kiln serve` of a GPU-compiled artifact on a CPU: Triton and generated kernels are replaced by
    # their op's torch reference (kernels asking for `sizes` get it dropped).
    source = make_hf_model("qwen3", tmp_path / "src")
    artifacts = {backend: compile_model(source, tmp_path / f"{backend}.kiln", CompileOptions(
        dtype="fp32", page_size=4, max_batch_tokens=32, max_logit_rows=32, backend=backend))
        for backend in ("torch", "triton")}
    manifest = json.loads((artifacts["triton"] / "manifest.json").read_text())
    assert manifest["generated_kernels"] and "triton.paged_attention" in manifest["kernels"]
    out = tmp_path / "logits.pt"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", RUN_IN_FRESH_PROCESS, str(artifacts["triton"]), str(out)], check=True,
                   env=env, cwd=tmp_path)
    run = PagedRun(Executor(load_artifact(artifacts["torch"]), "cpu"), num_pages=64)
    run.add_sequences(2)
    torch.testing.assert_close(torch.load(out), run.step(PROMPTS, all_logits=True), atol=1e-5, rtol=1e-5)


def test_in_memory_source_compiles_like_its_directory(tmp_path):
    from kiln.compiler.sources.hf import MemoryTensors, ModelSource, load_hf_dir

    source_dir = make_hf_model("llama3", tmp_path / "src")
    on_disk = load_hf_dir(source_dir)
    in_memory = ModelSource(tmp_path / "memory", on_disk.config,
                            MemoryTensors({n: on_disk.tensors.get(n) for n in on_disk.tensors.names()}), (), "x")
    logits = []
    for name, source in (("disk", source_dir), ("memory", in_memory)):
        artifact = compile_model(source, tmp_path / f"{name}.kiln", CompileOptions(dtype="fp32", max_batch_tokens=32))
        run = PagedRun(Executor(load_artifact(artifact), "cpu"), num_pages=64)
        run.add_sequences(2)
        logits.append(run.step(PROMPTS))
    assert torch.equal(logits[0], logits[1])
