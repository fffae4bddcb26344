"""Fixtures the runtime tests share: the real SmolLM2 tokenizer, kiln's and transformers'."""

from __future__ import annotations

import pytest

from kiln.runtime.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return Tokenizer.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))
