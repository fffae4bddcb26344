"""kiln's logits equal HF transformers' on random-weight models of every supported architecture
(the mixture-of-experts ones included): a batch of prompts of different lengths prefilled together,
then greedy decode steps through the paged KV pool.

Tolerance: f32 on both sides; the only differences are summation order inside matmuls and the
attention softmax (kiln attends in f32 over gathered pages), which stay ~1e-6 on logits of
magnitude ~1; we allow 1e-4 so the check is about wiring, not about the last ulp. The MoE models
add the experts' sums (kiln sums a token's choices in f32 in another order than HF's index_add) and
the same top-k choices (a near-tie could flip one; these seeds have none).
"""

from __future__ import annotations

import pytest

from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.runtime.artifact import load_artifact
from kiln.runtime.worker.executor import Executor
from tests.support.hf_models import CONFIGS, load_hf, make_hf_model
from tests.support.parity import assert_prefill_and_decode_match
from tests.support.stepping import PagedRun

PROMPTS = [[1, 5, 9, 33, 2, 7, 100], [3, 4], [200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 210], [42]]
DECODE_STEPS = 5
TOLERANCE = 1e-4


# The MoE families share the dense ones' attention, which page size 1 already covers; they run at 4.
MOE_KINDS = {"mixtral", "mixtral_window", "qwen2_moe", "qwen3_moe"}
CASES = [(kind, page_size, backend) for kind in sorted(CONFIGS)
         for page_size, backend in [(1, "torch"), (4, "torch"), (4, "triton")]
         if not (kind in MOE_KINDS and page_size == 1)]


@pytest.mark.parametrize("kind, page_size, backend", CASES)
def test_prefill_and_decode_match_hf(tmp_path, kind, page_size, backend):
    """The triton backend runs its kernels (hand-written and generated) under the interpreter here."""
    source = make_hf_model(kind, tmp_path / kind)
    artifact = compile_model(source, tmp_path / "model.kiln", CompileOptions(
        dtype="fp32", page_size=page_size, max_batch_tokens=64, max_logit_rows=64, backend=backend))
    run = PagedRun(Executor(load_artifact(artifact), "cpu"), num_pages=128)
    assert_prefill_and_decode_match(run, load_hf(source), PROMPTS, DECODE_STEPS, TOLERANCE)
