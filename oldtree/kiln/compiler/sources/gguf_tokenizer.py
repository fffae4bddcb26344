"""HF tokenizer files rebuilt from a GGUF's vocabulary metadata.

A GGUF carries no ``tokenizer.json``: it stores the tokens, merges, token types and special-token
ids under ``tokenizer.ggml.*``, and names the pre-tokenizer the merges were learned with
(``tokenizer.ggml.pre``) instead of spelling it out. ``write_tokenizer_files`` turns that into
``tokenizer.json`` (built with the ``tokenizers`` library), ``tokenizer_config.json`` (special
tokens, BOS/EOS flags, chat template) and ``generation_config.json``.

Each ``tokenizer.ggml.pre`` value maps to the pre-tokenizer of the model's own HF tokenizer.json,
which is also what llama.cpp applies for that name (``PRE_TOKENIZERS``). Only byte-level BPE
vocabularies (``tokenizer.ggml.model == "gpt2"``) are supported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from .hf import SourceError

# llama.cpp's token types (enum llama_token_type)
CONTROL_TOKEN = 3
USER_DEFINED_TOKEN = 4

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _gpt2_split() -> pre_tokenizers.PreTokenizer:
    # ByteLevel with use_regex applies GPT-2's split regex before mapping bytes to its alphabet
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_split() -> pre_tokenizers.PreTokenizer:
    # Every digit on its own first, then GPT-2's regex on the stretches between: "a  1" gives
    # "a", "  ", "1", where GPT-2's regex alone would give "a", " ", " 1".
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_split()])


def _llama3_split() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


@dataclass(frozen=True)
class PreTokenization:
    build: Callable[[], pre_tokenizers.PreTokenizer]
    # Llama 3 looks a whole pre-token up in the vocabulary before merging (HF's BPE ignore_merges)
    ignore_merges: bool = False


PRE_TOKENIZERS: dict[str, PreTokenization] = {
    "gpt2": PreTokenization(_gpt2_split),
    # SmolLM/SmolLM2's tokenizer.json: Sequence[Digits(individual_digits), ByteLevel(use_regex)];
    # llama.cpp groups the StarCoder-derived vocabularies under the same rule.
    "smollm": PreTokenization(_digits_then_gpt2_split),
    "starcoder": PreTokenization(_digits_then_gpt2_split),
    "refact": PreTokenization(_digits_then_gpt2_split),
    "codeshell": PreTokenization(_digits_then_gpt2_split),
    "llama-bpe": PreTokenization(_llama3_split, ignore_merges=True),
    "llama3": PreTokenization(_llama3_split, ignore_merges=True),
}

SUPPORTED_TOKENIZER_MODELS = ("gpt2",)


def write_tokenizer_files(metadata: Mapping[str, Any], out_dir: Path, source: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json into ``out_dir``."""
    build_tokenizer(metadata, source).save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(metadata))
    _write_json(out_dir / "generation_config.json", generation_config(metadata))


def build_tokenizer(metadata: Mapping[str, Any], source: Path) -> Tokenizer:
    model = metadata.get("tokenizer.ggml.model")
    if model not in SUPPORTED_TOKENIZER_MODELS:
        raise SourceError(f"{source}: tokenizer model {model!r} is not supported; "
                          f"supported: {', '.join(SUPPORTED_TOKENIZER_MODELS)}")
    pre_name = metadata.get("tokenizer.ggml.pre", "gpt2")
    if pre_name not in PRE_TOKENIZERS:
        raise SourceError(f"{source}: pre-tokenizer {pre_name!r} (tokenizer.ggml.pre) is not supported; "
                          f"supported: {', '.join(sorted(PRE_TOKENIZERS))}")
    pre = PRE_TOKENIZERS[pre_name]
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]

    tokenizer = Tokenizer(models.BPE(vocab={token: index for index, token in enumerate(tokens)},
                                     merges=_merges(metadata, source), ignore_merges=pre.ignore_merges))
    tokenizer.pre_tokenizer = pre.build()
    tokenizer.decoder = decoders.ByteLevel()
    token_types = metadata.get("tokenizer.ggml.token_type", [])
    # Tokens llama.cpp matches whole in raw text: control tokens as special, user-defined ones as plain
    # added tokens. They are in the vocabulary already, so they keep their ids.
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                  for token, kind in zip(tokens, token_types) if kind == CONTROL_TOKEN])
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False)
                          for token, kind in zip(tokens, token_types) if kind == USER_DEFINED_TOKEN])
    tokenizer.post_processor = _post_processor(metadata)
    return tokenizer


def _merges(metadata: Mapping[str, Any], source: Path) -> list[tuple[str, str]]:
    merges = []
    for rank, merge in enumerate(metadata.get("tokenizer.ggml.merges", [])):
        # byte-level tokens spell a space as "Ġ", so the one real space separates the pair
        pair = merge.split(" ")
        if len(pair) != 2:
            raise SourceError(f"{source}: merge {rank} ({merge!r}) is not two tokens separated by a space")
        merges.append((pair[0], pair[1]))
    return merges


def _post_processor(metadata: Mapping[str, Any]) -> processors.PostProcessor:
    """BOS/EOS around each sequence where the GGUF's add_bos/add_eos flags ask for them; else nothing added."""
    tokens = metadata["tokenizer.ggml.tokens"]

    def added(which: str) -> list[tuple[str, int]]:
        token_id = metadata.get(f"tokenizer.ggml.{which}_token_id")
        if token_id is None or not metadata.get(f"tokenizer.ggml.add_{which}_token", False):
            return []
        return [(tokens[token_id], token_id)]

    bos, eos = added("bos"), added("eos")
    if not bos and not eos:
        return processors.ByteLevel(trim_offsets=False)
    first, last = [token for token, _ in bos], [token for token, _ in eos]
    return processors.TemplateProcessing(single=" ".join(first + ["$A"] + last),
                                         pair=" ".join(first + ["$A"] + last + first + ["$B:1"] + last),
                                         special_tokens=list(dict.fromkeys(bos + eos)))


def _special_token(metadata: Mapping[str, Any], key: str) -> str | None:
    token_id = metadata.get(f"tokenizer.ggml.{key}")
    return None if token_id is None else metadata["tokenizer.ggml.tokens"][token_id]


def tokenizer_config(metadata: Mapping[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _special_token(metadata, "bos_token_id"),
        "eos_token": _special_token(metadata, "eos_token_id"),
        "unk_token": _special_token(metadata, "unknown_token_id"),
        "pad_token": _special_token(metadata, "padding_token_id"),
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    context = metadata.get(f"{metadata.get('general.architecture')}.context_length")
    if context is not None:
        config["model_max_length"] = context
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return config


def generation_config(metadata: Mapping[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    if "tokenizer.ggml.bos_token_id" in metadata:
        config["bos_token_id"] = metadata["tokenizer.ggml.bos_token_id"]
    # A chat model may end a turn with an end-of-turn token distinct from EOS; generation stops at either.
    stops = [metadata[f"tokenizer.ggml.{key}"] for key in ("eos_token_id", "eot_token_id")
             if f"tokenizer.ggml.{key}" in metadata]
    stops = list(dict.fromkeys(stops))
    if stops:
        config["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    return config


def _write_json(path: Path, content: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
