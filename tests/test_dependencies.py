"""pyproject.toml's ranges against what the tests run with: every installed dependency satisfies
its range, and Triton's range is exactly the tested minor release (newer ones break the
interpreter path of the attention kernels, see pyproject.toml)."""

from __future__ import annotations

import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def requirements() -> list[Requirement]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    listed = project["dependencies"] + project["optional-dependencies"]["test"]
    return [r for r in map(Requirement, listed) if r.marker is None or r.marker.evaluate()]


def test_installed_versions_satisfy_the_declared_ranges():
    for requirement in requirements():
        try:
            installed = version(requirement.name)
        except PackageNotFoundError:
            raise AssertionError(f"{requirement.name} is declared but not installed") from None
        assert requirement.specifier.contains(installed, prereleases=True), \
            f"{requirement.name} {installed} is outside the declared {requirement.specifier}"


def test_triton_range_is_the_tested_release():
    triton = next(r for r in requirements() if r.name == "triton")
    assert triton.specifier.contains("3.6.0") and not triton.specifier.contains("3.7.0")
    assert not triton.specifier.contains("3.5.0")
