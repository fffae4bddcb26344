"""Parity with HF transformers on the real SmolLM2-135M-Instruct weights (Q4_1 GGUF dequantized to
f32): a batch of prompts of different lengths prefilled together, then greedy decode steps through
the paged KV pool.

Tolerance: both sides run in f32 on the same weights; differences come from summation order
(batched GEMMs over packed sequences, kiln's attention over gathered pages) and grow through 30
layers to ~1e-4 on logits of magnitude ~20. We allow 2e-3: far below the gap between the top two
logits that would flip an argmax, and far above f32 rounding noise.
"""

from __future__ import annotations

import pytest
import torch

from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.runtime.artifact import load_artifact
from kiln.runtime.text.tokenizer import Tokenizer
from kiln.runtime.worker.executor import Executor
from tests.support.parity import assert_prefill_and_decode_match
from tests.support.stepping import PagedRun

TEXTS = ["What is the capital of France?", "def fibonacci(n):\n    ", "The quick brown fox",
         "Once upon a time, in a land far away, there lived a dragon who loved to read books about"]
DECODE_STEPS = 6
TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def setup(smollm2_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    artifact = compile_model(smollm2_dir, tmp_path_factory.mktemp("smol") / "smol.kiln", CompileOptions(
        dtype="fp32", page_size=16, max_batch_tokens=128, max_logit_rows=128, max_seq_len=512))
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_dir(artifact / "tokenizer")
    return artifact, hf, [tokenizer.encode(t) for t in TEXTS]


def test_prefill_and_decode_logits_match_hf(setup):
    artifact, hf, prompts = setup
    run = PagedRun(Executor(load_artifact(artifact), "cpu"), num_pages=64)
    assert_prefill_and_decode_match(run, hf, prompts, DECODE_STEPS, TOLERANCE)
