"""build_tokenizer_info (no transformers) gives what xgrammar's from_huggingface(AutoTokenizer) gives,
except that non-stop special tokens are blanked so grammars cannot spell text with them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import xgrammar
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from kiln.runtime.grammar import build_tokenizer_info
from kiln.runtime.text.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")


def reference_info(directory: Path, vocab_size: int) -> xgrammar.TokenizerInfo:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    return xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)


def assert_same_info(ours: xgrammar.TokenizerInfo, reference: xgrammar.TokenizerInfo, blanked: set[int]) -> None:
    assert ours.vocab_type == reference.vocab_type
    assert ours.add_prefix_space == reference.add_prefix_space
    assert ours.vocab_size == reference.vocab_size
    assert ours.stop_token_ids == reference.stop_token_ids
    ours_vocab, reference_vocab = ours.decoded_vocab, reference.decoded_vocab
    assert len(ours_vocab) == len(reference_vocab) == ours.vocab_size
    differing = {i for i, (a, b) in enumerate(zip(ours_vocab, reference_vocab)) if a != b}
    assert differing == {i for i in blanked if reference_vocab[i]}
    assert all(ours_vocab[i] == b"" for i in blanked)
    assert blanked <= set(ours.special_token_ids)


def blanked_ids(directory: Path, vocab_size: int) -> set[int]:
    tokenizer = Tokenizer.from_dir(directory)
    return {i for i in tokenizer.special_token_ids - tokenizer.eos_token_ids if i < vocab_size}


@pytest.mark.parametrize("extra_rows", [0, 20, -100])
def test_smollm2_matches_from_huggingface(smollm2_dir, extra_rows):
    # extra_rows > 0: logits wider than the vocabulary (padding); < 0: narrower (ids dropped).
    vocab_size = 49152 + extra_rows
    ours = build_tokenizer_info(smollm2_dir, vocab_size)
    assert_same_info(ours, reference_info(smollm2_dir, vocab_size), blanked_ids(smollm2_dir, vocab_size))
    assert ours.vocab_type == xgrammar.VocabType.BYTE_LEVEL
    assert set(range(49152, vocab_size)) <= set(ours.special_token_ids)


def test_vocabulary_overrides_a_missing_decoder(smollm2_dir, tmp_path):
    # Without a decoder the serialized tokenizer says "raw"; the byte-level vocabulary decides.
    spec = json.loads((Path(smollm2_dir) / "tokenizer.json").read_text())
    spec["decoder"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    shutil.copy(Path(smollm2_dir) / "tokenizer_config.json", tmp_path)
    ours = build_tokenizer_info(tmp_path, 49152)
    assert ours.vocab_type == xgrammar.VocabType.BYTE_LEVEL
    assert_same_info(ours, reference_info(tmp_path, 49152), blanked_ids(tmp_path, 49152))


def _byte_fallback_tokenizer(metaspace: bool) -> BackendTokenizer:
    """A tiny Llama-style tokenizer: "<0xNN>" byte pieces, "▁" for spaces, a prepended space."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{byte:02X}>": 3 + byte for byte in range(256)}}
    for piece in ["▁", "a", "b", "ab", "▁a", "▁ab", "{", "}", '"', ":", "1"]:
        vocab[piece] = len(vocab)
    merges = [("a", "b"), ("▁", "a"), ("▁a", "b")]
    tokenizer = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    if metaspace:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    else:
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    return tokenizer


def _byte_level_tokenizer() -> BackendTokenizer:
    """A tiny GPT-2-style tokenizer: the 256-character byte alphabet, a prefix space when encoding."""
    vocab = {"<|endoftext|>": 0}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    for piece in ["Ġa", "ab", "Ġab"]:
        vocab[piece] = len(vocab)
    tokenizer = BackendTokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "a"), ("a", "b"), ("Ġa", "b")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    return tokenizer


@pytest.mark.parametrize(("make", "config", "vocab_type"), [
    (lambda: _byte_fallback_tokenizer(metaspace=False), {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
     xgrammar.VocabType.BYTE_FALLBACK),
    (lambda: _byte_fallback_tokenizer(metaspace=True), {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
     xgrammar.VocabType.BYTE_FALLBACK),
    (_byte_level_tokenizer, {"eos_token": "<|endoftext|>"}, xgrammar.VocabType.BYTE_LEVEL),
], ids=["byte_fallback_normalizer", "byte_fallback_metaspace", "byte_level_prefix_space"])
def test_small_tokenizers_match_from_huggingface(tmp_path, make, config, vocab_type):
    backend = make()
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                                **config}))
    vocab_size = backend.get_vocab_size() + 7
    ours = build_tokenizer_info(tmp_path, vocab_size)
    assert ours.vocab_type == vocab_type
    assert_same_info(ours, reference_info(tmp_path, vocab_size), blanked_ids(tmp_path, vocab_size))


def test_stop_tokens_default_to_the_tokenizers_eos_ids_and_can_be_given(smollm2_tokenizer):
    assert build_tokenizer_info(smollm2_tokenizer, 49152).stop_token_ids == [2]
    given = build_tokenizer_info(smollm2_tokenizer, 49152, stop_token_ids=[0, 2])
    assert given.stop_token_ids == [0, 2]
    assert given.decoded_vocab[0] == b"<|endoftext|>"  # a stop token keeps its text
    with pytest.raises(ValueError, match=r"stop token ids \[60000\] are outside the logits width 49152"):
        build_tokenizer_info(smollm2_tokenizer, 49152, stop_token_ids=[60000])
