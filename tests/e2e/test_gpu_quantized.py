"""On the GPU: quantized artifacts on the triton backend (the quantized GEMV at decode, captured in CUDA
graphs; ``_scaled_mm``, ``_int_mm`` or dequantize + cuBLAS at prefill) against the same artifact on the
torch references, for every quantization method, on a Llama-3-8B shape cut to 2 layers. Skipped
without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.engine_options import EngineOptions
from tests.e2e.test_gpu import BUCKETS, NEW_TOKENS, generate
from tests.support.stepping import PagedRun

pytestmark = pytest.mark.gpu


def _compile(source, tmp_path: Path, backend: str, quantization: str | None, lm_head: bool = False) -> Path:
    return compile_model(source, tmp_path / f"{backend}-{quantization}-{lm_head}.kiln", CompileOptions(
        dtype="bf16", backend=backend, max_batch_tokens=512, max_batch_size=8, max_logit_rows=512,
        max_seq_len=256, page_size=16, quantization=quantization, quantize_lm_head=lm_head))


def _logits(core: EngineCore, prompts: list[list[int]]) -> torch.Tensor:
    run = PagedRun(core.runner.executor, num_pages=64)
    run.add_sequences(len(prompts))
    return run.step(prompts, all_logits=True).float()


@pytest.mark.parametrize("quantization, lm_head", [("fp8", False), ("w8a8_int8", False), ("w8a16_int8", False),
                                                    ("mxfp4", False), ("fp8", True)])
def test_quantized_triton_engine_matches_the_references(tmp_path, quantization, lm_head):
    """``lm_head``: the lm_head quantized too (quantize_lm_head), a GEMV over the whole vocabulary."""
    from models import random_model  # bench/ is on sys.path through tests.e2e.test_gpu

    if quantization == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9 or later")
    _, source = random_model("llama3-8b", torch.bfloat16, 2)
    fast = EngineCore(str(_compile(source, tmp_path, "triton", quantization, lm_head)),
                      EngineOptions(device="cuda", kv_cache_tokens=4096, decode_buckets=BUCKETS))
    reference = EngineCore(str(_compile(source, tmp_path, "torch", quantization, lm_head)),
                           EngineOptions(device="cuda", kv_cache_tokens=4096))
    unquantized = EngineCore(str(_compile(source, tmp_path, "torch", None)),
                             EngineOptions(device="cuda", kv_cache_tokens=4096))
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128256, (n,), generator=generator).tolist() for n in (5, 17, 33, 64)]
    # Prefill of all four (119 rows: the library GEMMs, or the GEMV in row blocks for weight-only).
    got, expected, exact = _logits(fast, prompts), _logits(reference, prompts), _logits(unquantized, prompts)
    # With activations quantized per token, a bf16 ulp of difference before a quantizer (fused
    # RMSNorm or SiLU·mul prologues round differently from the unfused references) moves a value by a
    # whole fp8/int8 step, and two layers carry that on: on an H100 the fast and reference fp8 logits
    # differ by up to 0.43 std, each being 0.77 std from bf16. So the bar is the scheme's own error:
    # the fast path may be no further from the bf16 model than the reference is (mean over the
    # logits, 10% slack), and within 0.1 std of the reference where that error is smaller still.
    scheme_error = (expected - exact).abs().mean().item()
    assert (got - exact).abs().mean().item() <= 1.1 * scheme_error + 1e-3, \
        f"{quantization}: the fast path is further from bf16 than the reference ({scheme_error:.4f} mean)"
    margin = max(0.1 * expected.std().item(), (expected - exact).abs().max().item())
    error = (got - expected).abs().max().item()
    assert error <= margin, f"{quantization}: prefill logits differ by {error:.4f}, more than {margin:.4f}"
    # Decode: four rows, then one (the GEMV's tl.dot and broadcast paths), in CUDA graphs; each token
    # teacher-forced against the references' logits: within the same margin of their best token.
    for batch in (prompts, prompts[:1]):
        outputs = generate(fast, batch)
        for prompt, tokens in zip(batch, outputs):
            logits = _logits(reference, [prompt + tokens])
            for i, token in enumerate(tokens):
                row = logits[len(prompt) - 1 + i]
                assert row[token] >= row.max() - margin, \
                    f"{quantization}: decode token {i} of {NEW_TOKENS} is {token}, the references' argmax " \
                    f"{int(row.argmax())} ({row[token]:.3f} against {row.max():.3f}, margin {margin:.3f})"
