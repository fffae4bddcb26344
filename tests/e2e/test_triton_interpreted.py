"""The triton backend end to end on the CPU, under ``TRITON_INTERPRET=1``: a compiled model's whole step
program (fused GEMVs with their norm and SiLU prologues, the composed paths at more rows, the extend
and decode attention kernels with the fused rope/KV store, on-device sampling) against HF
transformers' greedy tokens, for the architectures' distinct paths (llama3 rope scaling, qwen2's
q/k/v bias, qwen3's q/k norms, mistral's sliding window, the MoE families' router top-k, expert-load
counter and experts: grouped GEMMs at prefill, per-pair GEMVs at decode). CI runs these; the GPU runs the same
program at real shapes (``test_gpu.py``). Small f32 models only: the interpreter runs every program
of a launch one after another."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.kernels.gemv import GEMV_MAX_ROWS
from kiln.kernels.triton_support import INTERPRET
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.engine_options import EngineOptions
from kiln.runtime.sampling import SamplingParams
from tests.support.hf_models import hf_greedy, make_hf_model

pytestmark = pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels on the CPU's interpreter")

# The second prompt is longer than GEMV_MAX_ROWS (its prefill takes the composed GEMM paths); the
# first stops earlier, so the last decode steps run one row (the broadcast GEMV) after two (tl.dot).
PROMPTS = [[1, 5, 9, 3, 7], list(range(2, 3 + GEMV_MAX_ROWS + 4))]
NEW_TOKENS = [6, 10]
# The fused GEMMs every model's step runs on Triton; the attention differs by architecture (qwen3's
# q/k norms go into a generated rope/KV-store kernel before paged attention, the others' rope and KV
# store into decode attention itself).
FUSED_GEMMS = ("triton.rmsnorm_linear", "triton.linear_residual", "triton.silu_mul_linear_residual")
MOE = ("triton.linear", "triton.router_topk_count", "triton.moe_residual")
# Ops that stay on torch in a triton artifact: they move or reinterpret data and compute nothing.
DATA_MOVEMENT = ("torch.cast", "torch.embedding", "torch.gather_rows", "torch.reshape", "torch.split")


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "qwen3", "mistral_window", "qwen3_moe", "mixtral_window"])
def test_greedy_tokens_equal_hf(tmp_path: Path, kind: str):
    import transformers

    source = make_hf_model(kind, tmp_path / "src")
    artifact = compile_model(source, tmp_path / "m.kiln", CompileOptions(
        dtype="fp32", backend="triton", page_size=4, max_batch_tokens=64, max_batch_size=4, max_seq_len=64))
    kernels = json.loads((artifact / "manifest.json").read_text())["kernels"]
    sparse = kind in ("qwen3_moe", "mixtral_window")  # every layer's MLP is the experts: no silu_mul_linear
    assert all(name in kernels for name in (FUSED_GEMMS[:2] + MOE if sparse else FUSED_GEMMS)), kernels
    assert [name for name in kernels if name.startswith("torch.") and name not in DATA_MOVEMENT] == []
    outputs = _greedy(artifact)
    model = transformers.AutoModelForCausalLM.from_pretrained(source, torch_dtype=torch.float32).eval()
    for prompt, new_tokens, tokens in zip(PROMPTS, NEW_TOKENS, outputs):
        assert tokens == hf_greedy(model, prompt, new_tokens)


def _greedy(artifact: Path) -> list[list[int]]:
    core = EngineCore(str(artifact), EngineOptions(device="cpu", kv_cache_tokens=256))
    for i, (prompt, new_tokens) in enumerate(zip(PROMPTS, NEW_TOKENS)):
        core.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True))
    outputs: list[list[int]] = [[] for _ in PROMPTS]
    while core.has_work():
        for event in core.step():
            outputs[int(event.rid[1:])].extend(event.token_ids)
    return outputs


# fp8 (activations quantized per token before the GEMV) and mxfp4 (block-scaled nibbles); the int8 schemes take the
# same paths, each tested against its reference in tests/kernels/test_linear_quantized_triton.py.
@pytest.mark.parametrize("quantization, scheme", [("fp8", "fp8_channel"), ("mxfp4", "mxfp4")])
def test_quantized_triton_kernels_give_the_reference_tokens(tmp_path: Path, quantization: str, scheme: str):
    # The quantized GEMV at every fusion (decode at 1 and 2 rows, prefill in GEMM tiles) against the
    # same artifact on the torch references, which define the quantized semantics.
    source = make_hf_model("llama3", tmp_path / "src", hidden_size=64, intermediate_size=128)
    options = dict(dtype="fp32", page_size=4, max_batch_tokens=64, max_batch_size=4, max_seq_len=64,
                   quantization=quantization)
    triton_artifact = compile_model(source, tmp_path / "t.kiln", CompileOptions(backend="triton", **options))
    kernels = json.loads((triton_artifact / "manifest.json").read_text())["kernels"]
    assert all(f"{name}.{scheme}" in kernels for name in FUSED_GEMMS), kernels
    torch_artifact = compile_model(source, tmp_path / "r.kiln", CompileOptions(backend="torch", **options))
    assert _greedy(triton_artifact) == _greedy(torch_artifact)
