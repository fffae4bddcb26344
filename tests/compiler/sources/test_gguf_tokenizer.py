"""kiln.compiler.sources.gguf_tokenizer: tokenizer files rebuilt from a GGUF's vocabulary.

The converted SmolLM2 tokenizer is compared with transformers' GGUF tokenizer on varied text, with
one known, deliberate difference: transformers drops SmolLM2's digit split (see
``test_digits_split_before_the_gpt2_regex``). Synthetic metadata checks the options SmolLM2 does not use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, pre_tokenizers

from kiln.compiler.sources.aliases import locate_gguf
from kiln.compiler.sources.gguf_tokenizer import build_tokenizer
from kiln.compiler.sources.hf import SourceError

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world! How are you today?",
    "12345",
    "The year 2024 had 366 days; pi is 3.14159.",
    "def add(a, b):\n    return a + b\n\n\nclass Point:\n\tx: int = 0\n",
    "naïve café, Straße, Ελληνικά, русский",
    "emoji 😀🎉👍🏽 and CJK 日本語のテキスト 中文 한국어",
    "   leading spaces",
    "trailing spaces   ",
    "  both  \n\n  ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|><|im_end|><|endoftext|>",
    "don't won't I'm we'll they've",
    "",
]


@pytest.fixture(scope="module")
def reference_tokenizer():
    gguf_path = locate_gguf("smollm2-135m-instruct")
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def converted_tokenizer(smollm2_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_encodes_like_transformers_and_decodes_back(text: str, converted_tokenizer, reference_tokenizer) -> None:
    ids = converted_tokenizer.encode(text, add_special_tokens=True)
    assert ids == reference_tokenizer.encode(text, add_special_tokens=True)
    assert converted_tokenizer.decode(ids) == text


def test_special_tokens_stay_whole(smollm2_dir: Path, converted_tokenizer) -> None:
    assert converted_tokenizer.encode("<|im_start|>", add_special_tokens=False, parse_special_tokens=True) == [1]
    assert converted_tokenizer.encode("<|im_end|>", add_special_tokens=False, parse_special_tokens=True) == [2]
    ids = converted_tokenizer.encode("<|im_start|>user\nHi<|im_end|>", parse_special_tokens=True)
    assert converted_tokenizer.decode(ids, skip_special_tokens=True) == "user\nHi"
    added = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json")).get_added_tokens_decoder().values()
    special = {token.content for token in added if token.special}
    assert {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<file_sep>", "<jupyter_code>"} <= special
    assert len(special) == 17  # every token the GGUF marks CONTROL


def test_digits_split_before_the_gpt2_regex(smollm2_dir: Path, converted_tokenizer, reference_tokenizer) -> None:
    """SmolLM2's own tokenizer.json isolates digits first (llama.cpp's "smollm" rule does the same);
    transformers' GGUF tokenizer applies GPT-2's regex alone, so a space run before a digit differs."""
    pre_tokenizer = json.loads((smollm2_dir / "tokenizer.json").read_text())["pre_tokenizer"]
    assert [step["type"] for step in pre_tokenizer["pretokenizers"]] == ["Digits", "ByteLevel"]
    assert pre_tokenizer["pretokenizers"][0]["individual_digits"] is True

    for text, ours, theirs in [("a  1", ["a", "ĠĠ", "1"], ["a", "Ġ", "Ġ", "1"]),
                               ("    42", ["ĠĠĠĠ", "4", "2"], ["ĠĠĠ", "Ġ", "4", "2"])]:
        assert converted_tokenizer.convert_ids_to_tokens(converted_tokenizer.encode(text)) == ours
        assert reference_tokenizer.convert_ids_to_tokens(reference_tokenizer.encode(text)) == theirs


def test_chat_template_renders_chatml(converted_tokenizer) -> None:
    text = converted_tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                   tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def test_tokenizer_and_generation_config(smollm2_dir: Path, converted_tokenizer) -> None:
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["pad_token"], config["unk_token"]) == \
        ("<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    assert config["add_bos_token"] is False  # tokenizer.ggml.add_bos_token
    assert converted_tokenizer.encode("Hi") == converted_tokenizer.encode("Hi", add_special_tokens=False)
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2}


def _byte_level_metadata(**overrides: Any) -> dict[str, Any]:
    """GGUF tokenizer metadata for a minimal byte-level BPE: three control tokens, the byte alphabet, "He"."""
    tokens = ["<|endoftext|>", "<s>", "<filename>", *sorted(pre_tokenizers.ByteLevel.alphabet()), "He"]
    metadata = {"general.architecture": "llama", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
                "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (len(tokens) - 3),
                "tokenizer.ggml.merges": ["H e"], "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 0}
    return {**metadata, **{f"tokenizer.ggml.{key}": value for key, value in overrides.items()}}


def test_add_bos_flag_prepends_bos() -> None:
    assert build_tokenizer(_byte_level_metadata(), Path("x.gguf")).encode("Hei").tokens == ["He", "i"]
    tokenizer = build_tokenizer(_byte_level_metadata(add_bos_token=True), Path("x.gguf"))
    assert tokenizer.encode("Hei").tokens == ["<s>", "He", "i"]


def test_user_defined_tokens_are_added_but_not_special() -> None:
    metadata = _byte_level_metadata()
    metadata["tokenizer.ggml.token_type"][2] = 4  # <filename> is USER_DEFINED
    tokenizer = build_tokenizer(metadata, Path("x.gguf"))
    added = {token.content: token.special for token in tokenizer.get_added_tokens_decoder().values()}
    assert added == {"<|endoftext|>": True, "<s>": True, "<filename>": False}
    assert tokenizer.encode("a<filename>b").ids == [tokenizer.token_to_id("a"), 2, tokenizer.token_to_id("b")]


def test_llama3_pre_tokenizer_groups_three_digits() -> None:
    tokenizer = build_tokenizer(_byte_level_metadata(pre="llama-bpe"), Path("x.gguf"))
    pieces = [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str("year 12345")]
    assert pieces == ["year", "Ġ", "123", "45"]


def test_unsupported_tokenizer_model_is_named() -> None:
    with pytest.raises(SourceError, match=r"m\.gguf: tokenizer model 'llama' is not supported; supported: gpt2"):
        build_tokenizer(_byte_level_metadata(model="llama"), Path("m.gguf"))


def test_unsupported_pre_tokenizer_is_named() -> None:
    with pytest.raises(SourceError, match=r"pre-tokenizer 'mystery'.*supported: .*smollm"):
        build_tokenizer(_byte_level_metadata(pre="mystery"), Path("m.gguf"))
