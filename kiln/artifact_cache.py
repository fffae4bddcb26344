"""Compile on first use: a model path or alias becomes a cached artifact under ``KILN_HOME/artifacts``.

An artifact directory is used as it is. Anything else is compiled once per (source fingerprint,
compile options) and reused afterwards, so ``kiln serve smollm2-135m-instruct`` and
``Engine("smollm2-135m-instruct")`` pay the compile only the first time.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from kiln import __version__
from kiln.artifact_format import FORMAT_VERSION, MANIFEST
from kiln.paths import kiln_home


def is_artifact(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def ensure_artifact(model: str | Path, options) -> Path:
    """The artifact for ``model`` under ``options`` (a ``CompileOptions``), compiling it if needed."""
    if is_artifact(model):
        return Path(model)
    from kiln.compiler.compile import compile_model, load_source

    source = load_source(model)
    # The format version too: an artifact cached by an older kiln of the same version number would be
    # refused by this one's loader rather than recompiled.
    key = json.dumps({"fingerprint": source.fingerprint, "options": options.to_json(), "kiln": __version__,
                      "format": FORMAT_VERSION}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    slug = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(str(model)).name or "model")
    target = kiln_home() / "artifacts" / f"{slug}-{digest}.kiln"
    if is_artifact(target):
        return target
    return compile_model(model, target, options)


def artifact_model_name(path: str | Path) -> str:
    """The model's own name recorded in an artifact (an alias, or the source directory's name); for
    artifacts compiled before the name was recorded, the same rule applied to the recorded source."""
    model = json.loads((Path(path) / MANIFEST).read_text())["model"]
    if model.get("name"):
        return model["name"]
    source = Path(model["source"])
    return source.stem if source.suffix == ".gguf" else source.name
