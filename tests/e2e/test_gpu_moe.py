"""On the GPU: MoE models (the benchmark's Qwen3-30B-A3B and Mixtral-8x7B shapes, cut to a layer or
two) through the triton backend with decode CUDA graphs against HF transformers on the same random
weights: prefill logits at every position, then greedy decode. Skipped without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.engine_options import EngineOptions
from tests.e2e.test_gpu import BUCKETS, NEW_TOKENS, generate
from tests.support.hf_models import hf_greedy
from tests.support.stepping import PagedRun

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape, layers", [("qwen3-30b-a3b", 2), ("mixtral-8x7b", 1)])
def test_moe_greedy_with_graphs_matches_hf(tmp_path, shape, layers):
    """f32 (IEEE dots), so routing and greedy paths agree exactly; prefill takes the grouped GEMMs (up
    to 64 tokens x top-k pairs) and decode the per-pair GEMVs at its small buckets."""
    from moe_decode import random_moe_model

    model, source = random_moe_model(shape, layers, dtype=torch.float32)
    artifact = compile_model(source, tmp_path / "m.kiln", CompileOptions(
        dtype="fp32", backend="triton", max_batch_tokens=512, max_batch_size=8, max_logit_rows=512,
        max_seq_len=256, page_size=16))
    core = EngineCore(str(artifact), EngineOptions(device="cuda", kv_cache_tokens=4096, decode_buckets=BUCKETS))
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=generator).tolist() for n in (5, 17, 33, 64)]
    run = PagedRun(core.runner.executor, num_pages=64)
    run.add_sequences(len(prompts))
    logits = run.step(prompts, all_logits=True)
    row = 0
    for prompt in prompts:
        with torch.no_grad():
            expected = model(torch.tensor([prompt], device="cuda")).logits[0].float()
        got = logits[row:row + len(prompt)]
        row += len(prompt)
        assert (got - expected).abs().max().item() < 1e-3 * expected.std().item()
    for prompt, tokens in zip(prompts, generate(core, prompts)):
        assert tokens == hf_greedy(model, prompt, NEW_TOKENS)
