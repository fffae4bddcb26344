"""``kiln bench NAME [ARGS...]``: runs a benchmark from the checkout's ``bench/`` directory.

The benchmarks a user runs are scripts beside the package (``decode.py``, ``offline.py``,
``serving.py``, ``structured.py``, ``disagg.py``, and ``kernel_bench.py`` as ``kiln bench kernels``); this runs one
with its own arguments, as ``python bench/NAME.py ARGS`` would. One-off probes of the engine's
internals live in ``bench/experiments/`` and are run directly, not listed here. An installed kiln
without the checkout has no ``bench/``, and says so.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"
# Modules the benchmarks import, not benchmarks themselves.
BENCH_HELPERS = frozenset({"models", "serving_stats"})
# Benchmarks named other than their file. The kernel benchmark's file is not kernels.py: the scripts
# run with bench/ first on sys.path, where a module named kernels shadows the `kernels` package that
# transformers imports when it is installed (transformers 5.25 installs it).
BENCH_NAMES = {"kernel_bench": "kernels"}


def available() -> list[str]:
    if not BENCH_DIR.is_dir():
        return []
    return sorted(BENCH_NAMES.get(p.stem, p.stem) for p in BENCH_DIR.glob("*.py") if p.stem not in BENCH_HELPERS)


def add_parser(commands) -> None:
    names = available()
    p = commands.add_parser("bench", help=f"run a benchmark ({', '.join(names) or 'none found'})",
                            description=__doc__.splitlines()[0])
    p.add_argument("name", help=f"one of: {', '.join(names)}")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark (see NAME --help)")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    names = available()
    if not names:
        raise FileNotFoundError(f"no bench/ directory beside the kiln package ({BENCH_DIR}); benchmarks run "
                                "from a checkout of the repository")
    if args.name not in names:
        raise ValueError(f"unknown benchmark {args.name!r}; available: {', '.join(names)}")
    files = {name: stem for stem, name in BENCH_NAMES.items()}
    script = BENCH_DIR / f"{files.get(args.name, args.name)}.py"
    saved = sys.argv
    sys.argv = [str(script), *args.args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    finally:
        sys.argv = saved
    return 0
