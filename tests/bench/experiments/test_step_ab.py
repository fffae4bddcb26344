"""bench/experiments/step_ab.py: variants and cases parse from the command line, step_breakdown.py's result line is
read back, and the table gives each variant's medians (or the failures) a case."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"
sys.path[:0] = [str(BENCH / "experiments"), str(BENCH)]
from step_ab import Case, Runs, Variant, parse_case, parse_step_line, parse_variant, run_once, table  # noqa: E402


def test_variants_take_a_tree_and_step_breakdown_arguments():
    assert parse_variant("main=@.") == Variant("main", Path("."), ())
    assert parse_variant("st3=@old --kernel-config decode_num_stages=3 --skip-pass dce") == Variant(
        "st3", Path("old"), ("--kernel-config", "decode_num_stages=3", "--skip-pass", "dce"))
    assert parse_variant("plain=") == Variant("plain", None, ())
    for bad in ("no-equals", "=@."):
        with pytest.raises(argparse.ArgumentTypeError, match="LABEL=SPEC"):
            parse_variant(bad)


def test_cases_are_shape_layers_batch():
    assert parse_case("llama3-8b:8:1") == Case("llama3-8b", 8, 1)
    assert parse_case("smollm2-135m::64") == Case("smollm2-135m", None, 64)
    assert Case("llama3-8b", 8, 1).args() == ["--shape", "llama3-8b", "--layers", "8", "--batch", "1"]
    assert str(Case("smollm2-135m", None, 64)) == "smollm2-135m batch 64"
    for bad in ("llama3-8b:8", "llama3-8b:x:1", ":8:1", "llama3-8b:8:"):
        with pytest.raises(argparse.ArgumentTypeError, match="SHAPE:LAYERS:BATCH"):
            parse_case(bad)


def test_reads_the_step_line():
    line = "llama3-8b batch 1: engine step 1.285 ms, graph replay alone 1.268 ms, host share 0.017 ms"
    assert parse_step_line("warning\n" + line + "\n") == (1.285, 1.268)
    assert parse_step_line("Traceback ...") is None


def test_table_gives_medians_and_failures():
    case = Case("llama3-8b", 8, 1)
    variants = [Variant("a", None, ()), Variant("b", None, ())]
    runs = {("a", case): Runs([1.3, 1.2, 1.25], [1.28, 1.18, 1.2]), ("b", case): Runs(failures=2)}
    assert table([case], variants, runs).splitlines() == [
        "| case | a | b |", "|---|---:|---:|",
        "| llama3-8b (8 layers) batch 1 | 1.250 (1.200) | - [2 failed] |"]


def test_a_run_without_a_result_is_a_failure():
    # step_breakdown.py needs a GPU, and an unknown shape fails before it looks for one.
    assert run_once(Variant("x", None, ()), Case("no-such-shape", None, 1), timeout=120) is None
