"""Whether a device can run an artifact's FP8 (kiln.runtime.device_support): what in an artifact needs
FP8, the refusal on a GPU older than compute capability 8.9 (naming what needs it and what to do), and
the torch references every kernel runs when the fallback is asked for."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.runtime.artifact import load_artifact
from kiln.runtime.device_support import fp8_needs, fp8_refusal, uses_references
from kiln.runtime.worker.executor import Executor, graph_blockers, kernel_table
from kiln.runtime.worker.step_streams import StepStreams
from tests.support.hf_models import make_hf_model
from tests.support.stepping import PagedRun

SMALL = dict(page_size=4, max_batch_tokens=32, max_logit_rows=32, max_seq_len=64, max_batch_size=4)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_hf_model("llama3", tmp_path_factory.mktemp("devsup") / "src", vocab_size=32, hidden_size=64,
                         intermediate_size=128)


@pytest.mark.parametrize("options,needs", [
    ({}, []),
    ({"quantization": "w8a16_int8"}, []),
    ({"quantization": "mxfp4"}, []),
    ({"quantization": "fp8"}, ["fp8_channel weights", "fp8_per_token activations"]),
    ({"kv_cache_dtype": "fp8_e4m3"}, ["an fp8_e4m3 KV cache"]),
    ({"quantization": "w8a8_int8", "kv_cache_dtype": "fp8_e4m3"}, ["an fp8_e4m3 KV cache"]),
])
def test_what_needs_fp8(source, tmp_path, options, needs):
    artifact = load_artifact(compile_model(source, tmp_path / "a.kiln", CompileOptions(**SMALL, **options)))
    assert fp8_needs(artifact) == needs
    assert not uses_references(artifact, torch.device("cpu"))  # the CPU runs every scheme's reference


def test_an_older_gpu_is_refused_with_what_to_do():
    message = fp8_refusal(["fp8_channel weights", "an fp8_e4m3 KV cache"], (8, 0), "cuda:0 (NVIDIA A100)")
    assert message.startswith("fp8_channel weights, an fp8_e4m3 KV cache need FP8, which needs a CUDA GPU of "
                              "compute capability 8.9 or newer (Ada, Hopper); cuda:0 (NVIDIA A100) is 8.0.")
    assert "--kv-cache-dtype auto" in message and "reference_fallback=True" in message
    assert "--reference-fallback" in message


@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0)])
def test_fp8_gpus_run_it(capability):
    assert fp8_refusal(["fp8_channel weights"], capability, "gpu") is None
    assert fp8_refusal([], (7, 5), "gpu") is None  # nothing needs FP8


def test_the_fallback_runs_every_kernels_torch_reference(source, tmp_path):
    """A Triton artifact bound to its references (as on an older GPU with the fallback) computes what
    the same artifact compiled for the torch backend does, bit for bit."""
    options = dict(**SMALL, quantization="fp8", kv_cache_dtype="fp8_e4m3")
    triton = load_artifact(compile_model(source, tmp_path / "t.kiln", CompileOptions(**options, backend="triton")))
    torch_backend = load_artifact(compile_model(source, tmp_path / "r.kiln", CompileOptions(**options)))
    assert any(name.startswith("triton.") for name in triton.manifest["kernels"])
    executor = Executor(triton, "cpu")
    executor.step_fn = triton.program.bind(kernel_table(triton, torch.device("cpu"), references=True),
                                           StepStreams(torch.device("cpu")))
    logits = []
    for ex in (executor, Executor(torch_backend, "cpu")):
        run = PagedRun(ex, num_pages=16)
        run.add_sequences(2)
        logits.append(run.step([[1, 2, 3, 4, 5], [9, 8, 7]], all_logits=True))
    assert torch.equal(logits[0], logits[1])
    # The references loop over the lengths on the host: no CUDA graph can capture them.
    assert graph_blockers(triton, references=True) and not graph_blockers(triton)


@pytest.mark.gpu
def test_this_gpu_runs_fp8_or_is_refused(source, tmp_path):
    artifact = load_artifact(compile_model(source, tmp_path / "a.kiln", CompileOptions(
        **SMALL, backend="triton", kv_cache_dtype="fp8_e4m3")))
    device = torch.device("cuda")
    if torch.cuda.get_device_capability(device) >= (8, 9):
        assert not uses_references(artifact, device)
    else:
        with pytest.raises(ValueError, match="need FP8"):
            uses_references(artifact, device)
        assert uses_references(artifact, device, reference_fallback=True)
