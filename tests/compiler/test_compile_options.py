"""The kernel config and pass selection as compile options: the manifest records both, the runtime
binds the recorded config to every kernel that reads one (generated kernels too) and the launchers
follow it, and skipping passes leaves the pipeline list as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.compiler.pipeline import PIPELINE, REQUIRED
from kiln.kernels import KernelConfig, get_impl, linear_fused
from kiln.kernels.triton_support import INTERPRET
from kiln.runtime.artifact import load_artifact
from kiln.runtime.worker.executor import Executor, kernel_table
from tests.support.hf_models import make_hf_model
from tests.support.stepping import PagedRun

SMALL = dict(dtype="fp32", page_size=4, max_batch_tokens=32, max_logit_rows=32)
# Never the fused GEMV: every fused linear takes the composed path (Triton norm and cuBLAS).
NO_GEMV = KernelConfig(pdl=False, gemv_max_weight_bytes=0, gemv_one_row_max_weight_bytes=0)


def compiled(source: Path, out: Path, **options) -> Path:
    return compile_model(source, out, CompileOptions(**SMALL, **options))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    """Qwen3: its q/k norms make a generated rope/KV-store kernel beside the registry's."""
    return make_hf_model("qwen3", tmp_path_factory.mktemp("options") / "src")


def test_the_manifest_records_the_config_and_the_runtime_binds_it(qwen3, tmp_path):
    artifact = load_artifact(compiled(qwen3, tmp_path / "m.kiln", backend="triton", kernel_config=NO_GEMV))
    manifest = json.loads((artifact.path / "manifest.json").read_text())
    assert manifest["options"]["kernel_config"] == NO_GEMV.to_json()
    assert manifest["options"]["kernel_config"]["gemv_block_k"] == [64, 1024]
    assert artifact.kernel_config == NO_GEMV
    table = kernel_table(artifact, torch.device("cuda" if not INTERPRET else "cpu"))
    assert any(name.startswith("generated.") for name in table)
    for name, fn in table.items():
        reads_config = name.startswith("generated.") or get_impl(name).wants_config
        assert getattr(fn, "keywords", {}).get("config") == (NO_GEMV if reads_config else None), name


@pytest.mark.skipif(not INTERPRET, reason="runs the Triton launchers under the interpreter")
def test_the_launchers_follow_the_recorded_config(qwen3, tmp_path, monkeypatch):
    gemv_calls = []
    launch_gemv = linear_fused.launch_gemv_for_rows
    monkeypatch.setattr(linear_fused, "launch_gemv_for_rows",
                        lambda *a, **k: (gemv_calls.append(1), launch_gemv(*a, **k)))
    logits = {}
    for label, config in (("default", KernelConfig()), ("no_gemv", NO_GEMV)):
        artifact = compiled(qwen3, tmp_path / f"{label}.kiln", backend="triton", kernel_config=config)
        run = PagedRun(Executor(load_artifact(artifact), "cpu"), num_pages=16)
        run.add_sequences(2)
        gemv_calls.clear()
        logits[label] = run.step([[1, 2, 3, 4, 5], [9, 8, 7]])
        assert bool(gemv_calls) == (label == "default"), label
    torch.testing.assert_close(logits["no_gemv"], logits["default"], atol=1e-4, rtol=1e-4)


def test_skipped_passes_are_recorded_and_the_pipeline_list_stays(qwen3, tmp_path):
    before = list(PIPELINE)
    skipped = ("fuse_add_rmsnorm", "fuse_silu_mul")
    artifact = compiled(qwen3, tmp_path / "m.kiln", skip_passes=skipped)
    assert PIPELINE == before
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["options"]["skip_passes"] == list(skipped)
    assert [entry["pass"] for entry in manifest["passes"]] == [name for name, _ in PIPELINE if name not in skipped]
    # Without silu·mul fused, the down projection cannot absorb it either.
    graph = (artifact / "graph.txt").read_text()
    assert " = silu(" in graph and "silu_mul_linear_residual(" not in graph
    # The next compile runs every pass again.
    full = compiled(qwen3, tmp_path / "full.kiln")
    assert " = silu(" not in (full / "graph.txt").read_text()


def test_unknown_and_required_passes_are_refused():
    with pytest.raises(ValueError, match="cannot skip fuse_everything: no such pass; passes: verify, expose_hidden_states, tree_attention, shard_tp, split_pipeline, place_experts, shard_ep, count_expert_load, fuse_router_count, fuse_linears, "):
        CompileOptions(skip_passes=("fuse_everything",)).validate()
    for name in sorted(REQUIRED):
        with pytest.raises(ValueError, match=f"cannot skip {name}: every artifact needs it; skippable passes: place_experts, count_expert_load, fuse_"):
            CompileOptions(skip_passes=(name,)).validate()


def test_a_config_that_is_no_kernel_config_is_refused():
    with pytest.raises(ValueError, match="kernel_config must be a KernelConfig, got dict"):
        CompileOptions(kernel_config={"pdl": False}).validate()


@pytest.mark.parametrize("ep, tp, message", [
    (0, 1, "ep must be >= 1, got 0"),
    (4, 6, "ep=4 with tp=6 is not supported"),
    (4, 2, "ep=4 with tp=2 is not supported"),
])
def test_ep_and_tp_mixes_the_pass_does_not_lay_out_are_refused(ep, tp, message):
    with pytest.raises(ValueError, match=message):
        CompileOptions(ep=ep, tp=tp).validate()
    assert CompileOptions(ep=2).ranks == CompileOptions(ep=2, tp=2).ranks == CompileOptions(tp=2).ranks == 2
    assert CompileOptions(ep=2, tp=4).ranks == 4
