"""The benchmark scripts run with bench/ first on sys.path, so each file's name is a top-level module
name there: none may be the import name of an installed package, or whatever imports that package
(transformers imports `kernels` when it is installed) gets our script instead."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_no_bench_module_shadows_an_installed_package():
    installed = importlib.metadata.packages_distributions()
    shadowed = {p.stem: installed[p.stem] for p in BENCH.glob("*.py") if p.stem in installed}
    assert not shadowed, f"bench/ modules named like installed packages (rename them): {shadowed}"
