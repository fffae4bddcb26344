"""Fixtures the runtime tests share: the real SmolLM2 tokenizer, kiln's and transformers'; a tiny random
Llama-3 compiled for the engine-core tests, and HF's greedy continuations of it."""

from __future__ import annotations

import pytest

from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.runtime.text.tokenizer import Tokenizer
from tests.support.hf_models import hf_greedy, load_hf, make_hf_model

TINY_LLAMA_PAGE = 4  # small pages, so a few tokens cross page boundaries (eviction, prefix sharing)


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return Tokenizer.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """(HF source directory, compiled fp32 artifact) of a tiny random Llama-3: 16 sequences, 64 tokens."""
    tmp = tmp_path_factory.mktemp("core")
    source = make_hf_model("llama3", tmp / "src")
    artifact = compile_model(source, tmp / "m.kiln", CompileOptions(
        dtype="fp32", page_size=TINY_LLAMA_PAGE, max_batch_tokens=64, max_batch_size=16, max_seq_len=64))
    return source, artifact


@pytest.fixture(scope="module")
def tiny_llama_greedy(tiny_llama):
    """HF transformers' greedy continuation of a prompt by ``tiny_llama`` (cached per prompt and length)."""
    hf = load_hf(tiny_llama[0])
    cache = {}

    def run(prompt: list[int], n: int = 10) -> list[int]:
        key = (tuple(prompt), n)
        if key not in cache:
            cache[key] = hf_greedy(hf, prompt, n)
        return cache[key]

    return run
