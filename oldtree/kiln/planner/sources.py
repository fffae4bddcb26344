"""The config of a model, whatever names it, without reading its weights.

An artifact directory gives the config its manifest recorded (and the dtype, quantization and
context it was compiled with, as the plan's defaults); an HF directory its ``config.json``; a
``.gguf`` file or an alias the config kiln's GGUF source derives from the file's metadata (the
tensors are not dequantized).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.artifact_cache import is_artifact
from kiln.artifact_format import MANIFEST
from kiln.compiler.sources.aliases import ALIASES, locate_gguf
from kiln.compiler.sources.gguf import architecture_of, has_gguf_magic, hf_config, open_gguf, read_metadata
from kiln.compiler.sources.hf import SourceError, _read_json


@dataclass(frozen=True)
class ModelConfig:
    config: dict[str, Any]
    # What an artifact was compiled with (dtype, quantization, max_seq_len): the plan's defaults.
    compiled: dict[str, Any] = field(default_factory=dict)


def model_config(model: str | Path) -> ModelConfig:
    path = Path(model).expanduser()
    if is_artifact(path):
        manifest = json.loads((path / MANIFEST).read_text())
        options = manifest.get("options", {})
        return ModelConfig(manifest["model"]["config"], {
            "dtype": options.get("dtype"), "quantization": options.get("quantization"),
            "max_seq_len": manifest.get("runtime", {}).get("max_seq_len")})
    if path.is_dir():
        return ModelConfig(_read_json(path / "config.json", what="model config"))
    if path.is_file():
        if not has_gguf_magic(path):
            raise SourceError(f"{path}: neither a GGUF file, a model directory nor an artifact")
        return ModelConfig(_gguf_config(path))
    if str(model) in ALIASES:
        return ModelConfig(_gguf_config(locate_gguf(str(model))))
    raise FileNotFoundError(f"{model}: no such artifact, model directory, GGUF file or alias; "
                            f"known aliases: {', '.join(sorted(ALIASES))}")


def _gguf_config(path: Path) -> dict[str, Any]:
    reader = open_gguf(path)
    metadata = read_metadata(reader)
    return hf_config(metadata, architecture_of(metadata, path), {t.name for t in reader.tensors}, path)
