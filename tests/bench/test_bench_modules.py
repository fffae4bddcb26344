"""The benchmark scripts run with bench/ (experiments: bench/experiments/ too) first on sys.path, so
each file's name is a top-level module name there: none may be the import name of an installed
package, or whatever imports that package (transformers imports `kernels` when it is installed) gets
our script instead. And ``kiln bench`` lists the user benchmarks only, not the modules they import
or the experiments."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from kiln import cli_bench

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_no_bench_module_shadows_an_installed_package():
    installed = importlib.metadata.packages_distributions()
    modules = [*BENCH.glob("*.py"), *(BENCH / "experiments").glob("*.py")]
    shadowed = {p.stem: installed[p.stem] for p in modules if p.stem in installed}
    assert not shadowed, f"bench/ modules named like installed packages (rename them): {shadowed}"


def test_kiln_bench_lists_scripts_and_not_their_helpers():
    scripts = {cli_bench.BENCH_NAMES.get(p.stem, p.stem) for p in BENCH.glob("*.py")
               if 'if __name__ == "__main__":' in p.read_text()}
    assert set(cli_bench.available()) == scripts
    experiments = {p.stem for p in (BENCH / "experiments").glob("*.py")}
    assert experiments and not experiments & set(cli_bench.available())
