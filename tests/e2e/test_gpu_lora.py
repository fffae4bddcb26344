"""Multi-LoRA on the GPU: the Triton LoRA kernels (tiles of the step's grouping by adapter, for prefill
and inside the decode CUDA graphs) against the torch reference artifact, same random weights and
adapters, in f32 where the greedy tokens must agree exactly; one batch mixes the base model and three
adapters, and a second run swaps which sequence takes which adapter (the graphs take the slots as
data, and the grouping is made from them inside the graph)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.engine_options import EngineOptions
from kiln.runtime.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

pytestmark = pytest.mark.gpu
NEW_TOKENS = 12


def _cores(tmp_path: Path) -> dict[str, EngineCore]:
    from lora_decode import write_adapter
    from models import random_model

    _, source = random_model("smollm2-135m", torch.float32, layers=4)
    cores = {}
    for backend in ("triton", "torch"):
        artifact = compile_model(source, tmp_path / f"{backend}.kiln", CompileOptions(
            dtype="fp32", backend=backend, max_batch_tokens=512, max_batch_size=8, max_seq_len=256, max_loras=2,
            max_lora_rank=16))
        graphs = backend == "triton"
        cores[backend] = EngineCore(str(artifact), EngineOptions(
            device="cuda", kv_cache_tokens=4096, decode_buckets=(1, 2, 4, 8) if graphs else (),
            prefill_graphs=graphs))
        for i in range(3):
            directory = tmp_path / f"adapter{i}"
            if not directory.exists():
                write_adapter(directory, source.config, rank=8 + 4 * i, seed=i)
            cores[backend].load_lora(f"a{i}", str(directory))
    return cores


def _generate(core: EngineCore, prompts: list[list[int]], loras: list[str | None]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    out = [[] for _ in prompts]
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        if i == 2:  # the later ones prefill while the first ones decode
            for _ in range(3):
                for event in core.step():
                    out[int(event.rid.split("-")[1])].extend(event.token_ids)
        core.add_request(f"r{id(prompts)}-{i}", prompt, params, lora=lora)
    while core.has_work():
        for event in core.step():
            out[int(event.rid.split("-")[1])].extend(event.token_ids)
    return out


def test_triton_lora_matches_the_torch_reference_in_mixed_batches(tmp_path):
    cores = _cores(tmp_path)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 49152, (n,), generator=generator).tolist() for n in (5, 40, 17, 3, 64)]
    for loras in ([None, "a0", "a1", "a2", "a0"], ["a2", None, "a0", "a1", "a1"]):
        expected = _generate(cores["torch"], prompts, loras)
        assert _generate(cores["triton"], prompts, loras) == expected
        assert len({tuple(t) for t in expected}) > 1
