"""The Triton LoRA kernels inside a whole step program on the CPU (``TRITON_INTERPRET=1``): a tiny
Llama compiled for the triton backend with LoRA slots gives HF + PEFT's greedy tokens (the adapter
merged) for a batch mixing the base model and two adapters, prefill and decode in the same steps
(the step's rows grouped by adapter once, each hook's kernels in tiles of that grouping). The GPU runs
the same program at a real shape (``test_gpu_lora.py``)."""

from __future__ import annotations

import pytest

from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.kernels.triton_support import INTERPRET
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.engine_options import EngineOptions
from kiln.runtime.sampling import SamplingParams
from tests.support.hf_models import hf_greedy, make_hf_model
from tests.support.lora import load_merged, make_peft_adapter

pytestmark = pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels on the CPU's interpreter")

PROMPTS = [[1, 5, 9, 3, 7], list(range(2, 23)), [40, 41]]
LORAS = ["a0", None, "a1"]
NEW_TOKENS = 5


def test_triton_lora_program_matches_hf_with_peft_merged(tmp_path):
    source = make_hf_model("llama3", tmp_path / "src", num_hidden_layers=1)
    adapters = {"a0": make_peft_adapter(source, tmp_path / "a0", rank=4, seed=1),
                "a1": make_peft_adapter(source, tmp_path / "a1", rank=8, seed=2, use_rslora=True)}
    artifact = compile_model(source, tmp_path / "m.kiln", CompileOptions(
        dtype="fp32", backend="triton", page_size=4, max_batch_tokens=64, max_batch_size=4, max_seq_len=64,
        max_loras=2, max_lora_rank=8))
    manifest = (artifact / "manifest.json").read_text()
    assert all(f"triton.lora_{op}" in manifest for op in ("shrink", "expand", "groups"))
    core = EngineCore(str(artifact), EngineOptions(device="cpu", kv_cache_tokens=512))
    for name, path in adapters.items():
        core.load_lora(name, str(path))
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    out = {i: [] for i in range(len(PROMPTS))}
    core.add_request("0", PROMPTS[0], params, lora=LORAS[0])
    for event in core.step():  # the first request decodes while the others prefill
        out[int(event.rid)].extend(event.token_ids)
    for i in (1, 2):
        core.add_request(str(i), PROMPTS[i], params, lora=LORAS[i])
    while core.has_work():
        for event in core.step():
            out[int(event.rid)].extend(event.token_ids)
    for i, (prompt, name) in enumerate(zip(PROMPTS, LORAS)):
        assert out[i] == hf_greedy(load_merged(source, adapters[name] if name else None), prompt, NEW_TOKENS), name
