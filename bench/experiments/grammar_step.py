"""A constrained decode step's grammar work on the host, as the overlapped engine does it, by thread count.

The engine accepts a step's tokens (``GrammarState.accept_tokens``), starts the next step's mask fill
on its filler thread (``StepMasks.start``: xgrammar's batch fill on a thread per 16 rows, up to the
cap), does its own Python work (the tokens' application, the events, the next schedule: ~0.5 ms at
batch 64) and then waits for the fill. Threads help only where their start costs less than the fill
they share: on the GPU host, a VM, each xgrammar thread cost ~60 us to start (2026-12-07). This times
that step on the host it runs on (no GPU needed) for 16 and 64 rows of a JSON schema, at a mix of
positions and all inside a string (the dearest row), with each cap on the threads: the median step
from the accepts to the filled mask, in microseconds, the Python work included (its time alone is
printed first). The states are rolled back after each step.

    python bench/experiments/grammar_step.py --tokenizer-dir .bench-tokenizer --threads 1 2 4 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import xgrammar
from transformers import AutoTokenizer

from kiln.runtime.grammar import GrammarState
from kiln.runtime.grammar.step_mask import StepMasks

BENCH = Path(__file__).resolve().parent.parent
# Valid output prefixes: each row's state has accepted all but the last token, and accepts that next.
TEXTS = ['{"', '{"name": "John Smith', '{"name": "Jo", "age": 33', '{"name": "Jo", "age": 33, "hobbies": ["reading']


def python_work(seconds: float) -> None:
    """The engine thread's own Python between starting the fill and waiting for it."""
    end = time.perf_counter() + seconds
    total = 0
    while time.perf_counter() < end:
        total += 1


def rows_at(grammar, tokenizer, texts: list[str], rows: int) -> tuple[list[GrammarState], list[int]]:
    states, tokens = [], []
    for row in range(rows):
        ids = tokenizer.encode(texts[row % len(texts)], add_special_tokens=False)
        states.append(GrammarState.replay(grammar, ids[:-1]))
        tokens.append(ids[-1])
    return states, tokens


def engine_step(masks: StepMasks):
    """The overlapped engine's grammar work for one step, around ``work_s`` of its own Python."""
    def step(states, tokens, work_s):
        GrammarState.accept_tokens(states, tokens)
        pending = masks.start(states)
        python_work(work_s)
        pending.wait()
    return step


def timed_us(step, states, tokens, work_s: float, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        step(states, tokens, work_s)
        times.append(time.perf_counter() - start)
        for state in states:
            state.rollback(1)
    return 1e6 * statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer-dir", type=Path, required=True)
    parser.add_argument("--schema", type=Path, default=BENCH / "person_schema.json")
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--python-us", type=float, default=500.0, help="the engine thread's own work a step")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    grammar = xgrammar.GrammarCompiler(info).compile_json_schema(args.schema.read_text())
    work_s = args.python_us / 1e6
    alone = timed_us(lambda *_: python_work(work_s), [], [], work_s, args.repeats)
    print(f"# {os.cpu_count()} CPUs; us a step (median); the Python work alone {alone:.0f} us")
    print("| rows | at | " + " | ".join(f"at most {t} threads" for t in args.threads) + " |")
    print("|---|---|" + "---:|" * len(args.threads))
    results = {}
    for rows in args.rows:
        for label, texts in (("mixed positions", TEXTS), ("in a string", TEXTS[1:2])):
            states, tokens = rows_at(grammar, tokenizer, texts, rows)
            cells = [timed_us(engine_step(StepMasks(info.vocab_size, "cpu", threads)), states, tokens, work_s,
                              args.repeats) for threads in args.threads]
            results[f"{rows} rows, {label}"] = cells
            print(f"| {rows} | {label} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")
    print(json.dumps({"cpus": os.cpu_count(), "threads": args.threads, "python_us": alone, "steps_us": results}))


if __name__ == "__main__":
    main()
