"""The HF-directory source: ``config.json``, safetensors (single, or sharded with an index), tokenizer files.

Tensors are read lazily, one at a time, so compiling a large model never holds two copies of it.
A pre-quantized checkpoint (``quantization_config`` in config.json) has its weights read into kiln's
quantized formats (``prequantized.py``). Only safetensors are read: pickle-based ``.bin`` checkpoints can run code when loaded, so they are
refused with a message saying how to convert them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

if TYPE_CHECKING:
    from .prequantized import CheckpointQuantization

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "chat_template.json")


class SourceError(ValueError):
    """A model directory or file that cannot be compiled; the message names the file and the problem."""


class CheckpointTensors:
    """Name -> tensor over one or more safetensors files, opened lazily."""

    def __init__(self, files_by_name: dict[str, Path]) -> None:
        self._file_of = files_by_name

    def names(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def file_of(self, name: str) -> Path:
        return self._file_of[name]

    def get(self, name: str) -> torch.Tensor:
        path = self._file_of[name]
        try:
            with safe_open(str(path), framework="pt") as f:
                return f.get_tensor(name)
        except Exception as exc:  # safetensors raises several types for truncated/corrupt data
            raise SourceError(f"{path}: cannot read tensor {name!r}: {exc}") from None


class MemoryTensors(CheckpointTensors):
    """Name -> tensor from a state dict already in memory (benchmarks build random models this way,
    without writing a checkpoint first)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__({name: Path("<memory>") for name in tensors})
        self._tensors = tensors

    def get(self, name: str) -> torch.Tensor:
        return self._tensors[name]


@dataclass(frozen=True)
class ModelSource:
    path: Path
    config: dict[str, Any]
    tensors: CheckpointTensors
    tokenizer_files: tuple[Path, ...]
    fingerprint: str
    # A pre-quantized checkpoint's quantization (sources/prequantized.py); None: plain weights.
    quantization: CheckpointQuantization | None = None


def load_hf_dir(path: Path) -> ModelSource:
    path = Path(path)
    if not path.is_dir():
        raise SourceError(f"{path}: not a directory")
    # Here, not at the top: prequantized.py builds on this module's CheckpointTensors and SourceError.
    from .prequantized import PrequantizedTensors, read_quantization

    config = _read_json(path / "config.json", what="model config")
    files = _index_safetensors(path)
    quantization = read_quantization(config, path)
    tensors = CheckpointTensors(files) if quantization is None else PrequantizedTensors(files, quantization)
    tokenizer_files = tuple(path / n for n in TOKENIZER_FILES if (path / n).is_file())
    return ModelSource(path, config, tensors, tokenizer_files, _fingerprint(path, tensors), quantization)


def _read_json(file: Path, what: str) -> dict[str, Any]:
    if not file.is_file():
        raise SourceError(f"{file}: missing ({what}); an HF model directory needs config.json and *.safetensors")
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SourceError(f"{file}: not valid JSON: {exc}") from None


def _index_safetensors(path: Path) -> dict[str, Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise SourceError(f"{index}: has no weight_map")
        files = {name: path / shard for name, shard in weight_map.items()}
        for shard in set(files.values()):
            if not shard.is_file():
                raise SourceError(f"{shard}: listed in {index.name} but missing")
        return files
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        if any(path.glob("*.bin")) or any(path.glob("*.pt")):
            raise SourceError(f"{path}: only pickle checkpoints (.bin/.pt) found; kiln reads safetensors only, "
                              "because unpickling can execute code. Convert with transformers' "
                              "save_pretrained(..., safe_serialization=True).")
        raise SourceError(f"{path}: no *.safetensors files")
    files: dict[str, Path] = {}
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as f:
                for name in f.keys():
                    files[name] = shard
        except Exception as exc:
            raise SourceError(f"{shard}: not a readable safetensors file: {exc}") from None
    return files


def _fingerprint(path: Path, tensors: CheckpointTensors) -> str:
    """A cheap content fingerprint: config bytes plus each weight file's name, size and header."""
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for shard in sorted(set(tensors.file_of(n) for n in tensors.names())):
        with open(shard, "rb") as f:
            header = f.read(1 << 16)
        digest.update(shard.name.encode())
        digest.update(str(shard.stat().st_size).encode())
        digest.update(header)
    return digest.hexdigest()[:16]
