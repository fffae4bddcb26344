"""The executor's kernel table facts: which of a program's kernels keep a step capturable as a CUDA graph."""

from __future__ import annotations

import pytest

from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.runtime.artifact import load_artifact
from kiln.runtime.worker.executor import graph_blockers
from tests.support.hf_models import make_hf_model


@pytest.mark.parametrize("backend,blockers", [("torch", ["torch.rope_kv_attention"]), ("triton", [])])
def test_graph_blockers_are_the_kernels_that_read_the_device_on_the_host(tmp_path, backend, blockers):
    source = make_hf_model("llama3", tmp_path / "src")
    artifact = compile_model(source, tmp_path / "m.kiln", CompileOptions(
        dtype="fp32", backend=backend, max_batch_tokens=16, max_batch_size=2, max_seq_len=32))
    assert graph_blockers(load_artifact(str(artifact))) == blockers
