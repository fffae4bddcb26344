"""bench/moe_decode.py's model builder on the CPU, shrunk: the per-expert tensors it hands kiln (views
of HF's in-memory stacks) compile into a model whose logits match HF's, and a step's bytes count
top-k experts at batch 1."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from moe_decode import SHAPES, random_moe_model, step_bytes  # noqa: E402

from kiln.compiler.compile import compile_model  # noqa: E402
from kiln.compiler.options import CompileOptions  # noqa: E402
from kiln.runtime.artifact import load_artifact  # noqa: E402
from kiln.runtime.worker.executor import Executor  # noqa: E402
from tests.support.parity import assert_prefill_and_decode_match  # noqa: E402
from tests.support.stepping import PagedRun  # noqa: E402

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_bench_model_compiles_to_hf_parity(tmp_path, shape):
    overrides = {k: v for k, v in SMALL.items() if shape.startswith("qwen3") or k not in ("moe_intermediate_size",)}
    model, source = random_moe_model(shape, layers=1, dtype=torch.float32, device="cpu", overrides=overrides)
    artifact = compile_model(source, tmp_path / "m.kiln", CompileOptions(
        dtype="fp32", page_size=4, max_batch_tokens=32, max_logit_rows=32, backend="torch"))
    run = PagedRun(Executor(load_artifact(artifact), "cpu"), num_pages=32)
    assert_prefill_and_decode_match(run, model, [[1, 2, 3, 4, 5], [9, 8]], 2, 1e-4)


def test_step_bytes_counts_top_k_experts_at_batch_1():
    state = {"model.embed_tokens.weight": torch.zeros(10, 4), "lm_head.weight": torch.zeros(10, 4),
             "model.layers.0.mlp.experts.gate_up_proj": torch.zeros(8, 6, 4),
             "model.layers.0.mlp.experts.down_proj": torch.zeros(8, 4, 3)}
    one, exact = step_bytes(state, experts=8, top_k=2, batch=1)
    assert exact and one == 4 * (40 + 2 * (24 + 12))
    many, exact = step_bytes(state, experts=8, top_k=2, batch=64)
    assert not exact and one < many <= 4 * (40 + 8 * 36)
