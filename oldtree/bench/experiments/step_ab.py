"""A/B of decode steps in one GPU call: ``bench/experiments/step_breakdown.py`` for each variant and case, the
variants interleaved round by round (A B A B ...), since the same code measures a few percent apart
from one device call to the next and only runs of one call compare.

    python bench/experiments/step_ab.py --case llama3-8b:8:1 --case smollm2-135m::64 --repeat 2 \\
        --variant main=@. --variant before=@old \\
        --variant 'stages3=@. --kernel-config decode_num_stages=3'

A variant is ``LABEL=SPEC``: ``@DIR`` in SPEC runs the kiln tree under DIR (put first on PYTHONPATH;
make one with ``git archive REV kiln | tar x -C DIR``), everything else goes to step_breakdown.py
(``--kernel-config``, ``--skip-pass``). A case is ``SHAPE:LAYERS:BATCH`` (LAYERS empty for the whole model).
Prints one markdown row a case: each variant's median engine step and graph replay, in ms.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
STEP_LINE = re.compile(r"engine step ([0-9.]+) ms, graph replay alone ([0-9.]+) ms")


@dataclass(frozen=True)
class Variant:
    label: str
    tree: Path | None  # a kiln tree to import instead of the checkout's
    args: tuple[str, ...]


@dataclass(frozen=True)
class Case:
    shape: str
    layers: int | None
    batch: int

    def args(self) -> list[str]:
        layers = ["--layers", str(self.layers)] if self.layers is not None else []
        return ["--shape", self.shape, *layers, "--batch", str(self.batch)]

    def __str__(self) -> str:
        return f"{self.shape}{f' ({self.layers} layers)' if self.layers else ''} batch {self.batch}"


@dataclass
class Runs:
    steps: list[float] = field(default_factory=list)
    replays: list[float] = field(default_factory=list)
    failures: int = 0


def parse_variant(text: str) -> Variant:
    label, sep, spec = text.partition("=")
    if not sep or not label:
        raise argparse.ArgumentTypeError(f"variant {text!r} is not LABEL=SPEC")
    tree, args = None, []
    for token in shlex.split(spec):
        if token.startswith("@"):
            tree = Path(token[1:])
        else:
            args.append(token)
    return Variant(label, tree, tuple(args))


def parse_case(text: str) -> Case:
    parts = text.split(":")
    if len(parts) != 3 or not parts[0] or not parts[2].isdigit() or (parts[1] and not parts[1].isdigit()):
        raise argparse.ArgumentTypeError(f"case {text!r} is not SHAPE:LAYERS:BATCH (LAYERS may be empty)")
    return Case(parts[0], int(parts[1]) if parts[1] else None, int(parts[2]))


def parse_step_line(output: str) -> tuple[float, float] | None:
    """(engine step, graph replay) in ms from step_breakdown.py's output, or None if it has no result."""
    match = STEP_LINE.search(output)
    return (float(match.group(1)), float(match.group(2))) if match else None


def run_once(variant: Variant, case: Case, timeout: float) -> tuple[float, float] | None:
    env = dict(os.environ)
    if variant.tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(variant.tree.resolve()), env.get("PYTHONPATH")]))
    command = [sys.executable, str(BENCH / "step_breakdown.py"), "--top", "0", *case.args(), *variant.args]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    return parse_step_line(done.stdout)


def table(cases: list[Case], variants: list[Variant], runs: dict[tuple[str, Case], Runs]) -> str:
    """Markdown: a row a case, a column a variant: median engine step (median replay) in ms."""
    lines = ["| case | " + " | ".join(v.label for v in variants) + " |",
             "|---|" + "---:|" * len(variants)]
    for case in cases:
        cells = []
        for variant in variants:
            r = runs[(variant.label, case)]
            cell = (f"{statistics.median(r.steps):.3f} ({statistics.median(r.replays):.3f})" if r.steps else "-")
            cells.append(cell + (f" [{r.failures} failed]" if r.failures else ""))
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", type=parse_variant, action="append", required=True)
    parser.add_argument("--case", type=parse_case, action="append", required=True)
    parser.add_argument("--repeat", type=int, default=1, help="rounds over every variant and case")
    parser.add_argument("--timeout", type=float, default=90, help="seconds one step_breakdown.py run may take")
    parser.add_argument("--out", type=Path, default=None, help="also write every run's figures here as JSON")
    args = parser.parse_args()
    runs = {(v.label, c): Runs() for v in args.variant for c in args.case}
    for round_index in range(args.repeat):
        for case in args.case:
            for variant in args.variant:
                result = run_once(variant, case, args.timeout)
                r = runs[(variant.label, case)]
                if result is None:
                    r.failures += 1
                else:
                    r.steps.append(result[0])
                    r.replays.append(result[1])
                print(f"round {round_index + 1} {case} {variant.label}: {result}", flush=True)
    print(table(args.case, args.variant, runs))
    if args.out:
        args.out.write_text(json.dumps([{"variant": label, "case": str(case), **vars(r)}
                                        for (label, case), r in runs.items()], indent=1))


if __name__ == "__main__":
    main()
