"""Quantization on the real SmolLM2-135M-Instruct (CPU): perplexity through kiln's own logits on a fixed
English text (tests/data/perplexity_text.txt, 503 tokens) for bf16 and each method, within the bounds
issue 27 sets against bf16, and each method still answers the capital of France with Paris.

Measured (plain round-to-nearest, no calibration; 2026-12-06): bf16 17.728;
w8a16_int8 17.675 (0.997x); fp8 18.463 (1.041x); w8a8_int8 18.248 (1.029x); mxfp4 28.745 (1.621x); fp8
with the tied lm_head quantized too (``quantize_lm_head``) 18.528 (1.045x). The issue's simulation
predicted about +4% for w8a8_int8 and +61% for mxfp4. w8a8_int8 does not answer Paris: bf16's first
token is a near tie ('The' 25.62 against 'L' 25.50) and per-token INT8 activations flip it ('L' 24.12,
'The' 23.00); with either the 576-wide or the 1536-wide GEMM inputs left unquantized it is 'The' again.
An FP8 lm_head flips the same tie, which is why the head stays plain unless asked for. Calibration
(SmoothQuant-style scales folded into the norms) is the known remedy; until then those cases are
expected failures, kept strict so that they report when they pass.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kiln import Engine, SamplingParams
from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.runtime.artifact import load_artifact
from kiln.runtime.text.tokenizer import Tokenizer
from kiln.runtime.worker.executor import Executor
from tests.support.stepping import PagedRun

TEXT = Path(__file__).resolve().parents[1] / "data" / "perplexity_text.txt"
# Perplexity allowed, as a multiple of bf16's (issue 27); "+lm_head": the (tied) lm_head quantized too.
BOUNDS = {"fp8": 1.05, "w8a8_int8": 1.08, "w8a16_int8": 1.02, "mxfp4": 2.0, "fp8+lm_head": 1.05}


def _compile(smollm2_dir: Path, out: Path, variant: str | None) -> Path:
    method, _, head = (variant or "").partition("+")
    return compile_model(smollm2_dir, out, CompileOptions(
        dtype="bf16", page_size=16, max_batch_tokens=512, max_batch_size=4, max_logit_rows=512, max_seq_len=1024,
        quantization=method or None, quantize_lm_head=head == "lm_head"))


def _perplexity(artifact: Path, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of each token after the first, from one prefill's logits."""
    run = PagedRun(Executor(load_artifact(artifact), "cpu"), num_pages=40)
    run.add_sequences(1)
    logits = run.step([ids], all_logits=True).float()
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    return math.exp(nll.item())


@pytest.fixture(scope="module")
def measured(smollm2_dir, tmp_path_factory) -> dict[str, tuple[float, str]]:
    """Each method (None: bf16) mapped to its perplexity and its greedy answer to the capital question."""
    root = tmp_path_factory.mktemp("quant_smol")
    ids = Tokenizer.from_dir(smollm2_dir).encode(TEXT.read_text())
    results = {}
    for method in (None, *BOUNDS):
        artifact = _compile(smollm2_dir, root / f"{method or 'bf16'}.kiln", method)
        with Engine(str(artifact), device="cpu", kv_cache_tokens=1024) as engine:
            answer = engine.chat([{"role": "user", "content": "What is the capital of France?"}],
                                 SamplingParams(temperature=0, max_new_tokens=20)).text
        results[method] = (_perplexity(artifact, ids), answer)
    print("\n" + "\n".join(f"{m or 'bf16'}: perplexity {p:.3f}, answer {a!r}" for m, (p, a) in results.items()))
    return results


def test_the_text_is_about_500_tokens(smollm2_dir):
    assert 450 <= len(Tokenizer.from_dir(smollm2_dir).encode(TEXT.read_text())) <= 550


@pytest.mark.parametrize("method", list(BOUNDS))
def test_perplexity_within_the_bound(measured, method):
    reference, _ = measured[None]
    perplexity, _ = measured[method]
    assert perplexity < BOUNDS[method] * reference, \
        f"{method}: perplexity {perplexity:.3f} vs bf16 {reference:.3f} ({perplexity / reference:.3f}x)"


@pytest.mark.parametrize("method", [None, "fp8", pytest.param("w8a8_int8", marks=pytest.mark.xfail(
    strict=True, reason="per-token INT8 activations flip bf16's near-tie first token (see the module docstring)")),
    "w8a16_int8", "mxfp4", pytest.param("fp8+lm_head", marks=pytest.mark.xfail(
        strict=True, reason="an FP8 lm_head flips the same near-tie first token (see the module docstring)"))])
def test_answers_paris(measured, method):
    assert "Paris" in measured[method][1], f"{method}: {measured[method][1]!r}"
