"""The vocabulary as xgrammar sees it: an ``xgrammar.TokenizerInfo`` built from kiln's tokenizer.

xgrammar's own ``TokenizerInfo.from_huggingface`` wants a transformers tokenizer; kiln's runtime does
not load transformers tokenizers, so this builds the same object from what ``tokenizer.json`` holds:

- the encoded vocabulary (token strings as the model file spells them, added tokens included), laid
  out by id over the model's logits width: ids past the tokenizer's vocabulary (padding rows of the
  lm_head) get empty strings, which xgrammar never allows;
- the vocabulary type (byte-level BPE, SentencePiece byte fallback, or raw) and whether the
  tokenizer prepends a space, detected from the serialized tokenizer exactly as ``from_huggingface``
  does, including its check that the vocabulary itself agrees with the declared decoder.

One deliberate difference from ``from_huggingface``: the tokenizer's special tokens (chat markers
such as ``<|im_start|>``) are given empty strings, except the stop tokens. xgrammar would otherwise
let them spell their literal text inside a JSON string or a regex match, and the detokenizer, which
drops special tokens, would then return text that no longer matches the constraint.
"""

from __future__ import annotations

import os
from typing import Iterable, Mapping

import xgrammar

from ..text.token_bytes import BYTE_LEVEL_CHARS
from ..text.tokenizer import Tokenizer

# A byte-fallback vocabulary holds the 256 pieces "<0x00>".."<0xFF>"; half of them is proof enough.
_MIN_BYTE_PIECES = 128
# Added tokens (chat markers) may use characters outside the byte-level alphabet: tolerate 1%.
_BYTE_LEVEL_SHARE = 0.99


_BYTE_LEVEL_ALPHABET = frozenset(BYTE_LEVEL_CHARS)  # GPT-2's 256 stand-in characters for bytes


def vocab_type_of_vocab(vocab: Mapping[str, int]) -> xgrammar.VocabType | None:
    """The encoding the vocabulary's own spelling proves, or None when it proves neither."""
    if sum(f"<0x{byte:02X}>" in vocab for byte in range(256)) >= _MIN_BYTE_PIECES:
        return xgrammar.VocabType.BYTE_FALLBACK
    if sum(char in vocab for char in _BYTE_LEVEL_ALPHABET) < len(_BYTE_LEVEL_ALPHABET) // 2:
        return None
    in_alphabet = sum(all(char in _BYTE_LEVEL_ALPHABET for char in token) for token in vocab)
    return xgrammar.VocabType.BYTE_LEVEL if in_alphabet >= _BYTE_LEVEL_SHARE * len(vocab) else None


def _prepends_space_when_encoding(tokenizer: Tokenizer, vocab_type: xgrammar.VocabType) -> bool:
    """Whether encoding "a" yields a first token that starts with the encoded space."""
    tokens = tokenizer.backend.encode("a", add_special_tokens=False).tokens
    space = "▁" if vocab_type == xgrammar.VocabType.BYTE_FALLBACK else "Ġ"
    return bool(tokens) and tokens[0].startswith(space)


def detect_metadata(tokenizer: Tokenizer, vocab: Mapping[str, int]) -> tuple[xgrammar.VocabType, bool]:
    """(vocab type, add_prefix_space) as ``TokenizerInfo.from_huggingface`` detects them for a fast
    tokenizer: from the serialized decoder and normalizer first, and, where the vocabulary's own
    spelling contradicts that, the vocabulary's type with the prefix space observed by encoding."""
    metadata = xgrammar.TokenizerInfo._detect_metadata_from_hf(tokenizer.backend.to_str())
    declared, add_prefix_space = metadata["vocab_type"], bool(metadata["add_prefix_space"])
    observed = vocab_type_of_vocab(vocab)
    if observed is not None and observed != declared:
        return observed, _prepends_space_when_encoding(tokenizer, observed)
    return declared, add_prefix_space


def build_tokenizer_info(tokenizer: Tokenizer | str | os.PathLike[str], vocab_size: int,
                         stop_token_ids: Iterable[int] | None = None) -> xgrammar.TokenizerInfo:
    """The TokenizerInfo for a model whose logits are ``vocab_size`` wide.

    ``tokenizer`` is a kiln ``Tokenizer`` or an HF-layout directory holding ``tokenizer.json``.
    ``stop_token_ids`` default to the tokenizer's end-of-sequence ids (``eos_token`` and those of
    ``generation_config.json``); the grammar allows them only where its text may end.
    """
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = Tokenizer.from_dir(tokenizer)
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1 (got {vocab_size})")
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    stops = sorted(set(tokenizer.eos_token_ids if stop_token_ids is None else stop_token_ids))
    outside = [token_id for token_id in stops if not 0 <= token_id < vocab_size]
    if outside:
        raise ValueError(f"stop token ids {outside} are outside the logits width {vocab_size}")
    encoded_vocab = [""] * vocab_size
    for token, token_id in vocab.items():
        # A tokenizer may hold tokens the model cannot produce (ids past its logits): they are dropped.
        if token_id < vocab_size:
            encoded_vocab[token_id] = token
    for token_id in tokenizer.special_token_ids - set(stops):
        if token_id < vocab_size:
            encoded_vocab[token_id] = ""
    vocab_type, add_prefix_space = detect_metadata(tokenizer, vocab)
    # No stop ids at all: xgrammar then guesses them from the vocabulary (e.g. "</s>").
    return xgrammar.TokenizerInfo(encoded_vocab, vocab_type, vocab_size=vocab_size,
                                  stop_token_ids=stops or None, add_prefix_space=add_prefix_space)
