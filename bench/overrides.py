"""Tuning overrides shared by the GPU benchmarks: ``--set MODULE.NAME=VALUE`` sets a module constant
that kiln reads at launch time (e.g. ``kiln.kernels.attention_decode.MIN_SPLIT_TOKENS=64``), and
``--skip-pass NAME`` compiles without one pass of the pipeline, so one GPU session can compare
variants of the same run."""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
from types import ModuleType


def add_override_arguments(parser: argparse.ArgumentParser, skip_pass: bool = True) -> None:
    """``--set`` (and, unless ``skip_pass`` is off, ``--skip-pass``) for ``apply_overrides``."""
    parser.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                        help="override a kiln module constant for this run")
    if skip_pass:
        parser.add_argument("--skip-pass", action="append", default=[], metavar="NAME",
                            help="compile without this pass of the pipeline")


def set_constant(setting: str, flag: str = "--set") -> tuple[ModuleType, str, object]:
    """Applies one ``MODULE.NAME=VALUE`` setting (VALUE a Python literal); returns the module, the
    name and the value it replaced, so a caller can put it back. Exits naming ``flag`` if the module
    has no such constant."""
    name, value = setting.split("=", 1)
    module, attr = name.rsplit(".", 1)
    target = importlib.import_module(module)
    if not hasattr(target, attr):
        sys.exit(f"{flag}: {module} has no {attr}")
    old = getattr(target, attr)
    setattr(target, attr, ast.literal_eval(value))
    return target, attr, old


def apply_overrides(settings: list[str], skipped: list[str]) -> None:
    for setting in settings:
        set_constant(setting)
    if skipped:
        from kiln.compiler import pipeline

        unknown = set(skipped) - {name for name, _ in pipeline.PIPELINE}
        if unknown:
            sys.exit(f"--skip-pass: no pass named {sorted(unknown)}")
        pipeline.PIPELINE[:] = [(name, fn) for name, fn in pipeline.PIPELINE if name not in skipped]
