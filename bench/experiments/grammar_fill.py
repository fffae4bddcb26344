"""How fast xgrammar fills a step's grammar masks, by grammar position and by thread count.

A constrained decode step at batch 64 fills 64 bitmask rows while the host does the step's other work;
on an H100 the fill by xgrammar's ``BatchGrammarMatcher`` outlasted that work by 384 us a step
(``bench/structured.py``, session 27), and that matcher starts a new thread pool on every call. This
times, on the host it runs on (no GPU needed), one row's fill at several positions in a JSON schema's
output, and a batch of rows filled by ``BatchGrammarMatcher`` with each thread count and by kiln's
``GrammarWorkers`` (threads kept from call to call, a run of rows each, one native call a run): what
the fill costs and how much more threads buy.

    python bench/experiments/grammar_fill.py --tokenizer-dir .bench-tokenizer --rows 64 --threads 1 2 4 8 15
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import xgrammar
from transformers import AutoTokenizer

from kiln.runtime.grammar import GrammarState
from kiln.runtime.grammar.workers import GrammarWorkers, RowWork

BENCH = Path(__file__).resolve().parent.parent
# Outputs cut at a grammar position each: between fields, inside a string, inside an array's string.
POSITIONS = {"start": "", "in a string": '{"name": "John Sm', "after a number": '{"name": "Jo", "age": 3',
             "in an array's string": '{"name": "Jo", "age": 33, "hobbies": ["rea'}


def states_at(grammar: xgrammar.CompiledGrammar, token_ids: list[int], rows: int) -> list[GrammarState]:
    states = []
    for _ in range(rows):
        state = GrammarState(grammar)
        for token_id in token_ids:
            if not state.accept(token_id):
                raise SystemExit(f"the schema does not admit the text's token {token_id}")
        states.append(state)
    return states


def timed_us(fill, repeats: int) -> float:
    fill()  # warm: first calls size xgrammar's caches and start its threads
    start = time.perf_counter()
    for _ in range(repeats):
        fill()
    return 1e6 * (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer-dir", type=Path, required=True)
    parser.add_argument("--schema", type=Path, default=BENCH / "person_schema.json")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    grammar = xgrammar.GrammarCompiler(info).compile_json_schema(args.schema.read_text())
    mask = xgrammar.allocate_token_bitmask(args.rows, info.vocab_size)
    rows = list(range(args.rows))
    print(f"# {os.cpu_count()} CPUs; {args.rows} rows; us a fill")
    columns = " | ".join(f"xgrammar batch, {t} threads | kiln workers, {t} threads" for t in args.threads)
    print(f"| position | one row | {columns} |")
    print("|---|---:|" + "---:|---:|" * len(args.threads))
    for label, text in POSITIONS.items():
        states = states_at(grammar, tokenizer.encode(text, add_special_tokens=False), args.rows)
        matchers = [state._matcher for state in states]
        one_row = timed_us(lambda: states[0].fill_bitmask(mask, 0), args.repeats)
        cells = []
        for threads in args.threads:
            batch = xgrammar.BatchGrammarMatcher(threads)
            cells.append(timed_us(lambda: batch.batch_fill_next_token_bitmask(matchers, mask, rows), args.repeats))
            workers = GrammarWorkers(threads)
            work = [RowWork(state, row=row) for row, state in enumerate(states)]
            cells.append(timed_us(lambda: workers.start(work, mask).wait(), args.repeats))
            workers.shutdown()
        print(f"| {label} | {one_row:.1f} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")
    print(json.dumps({"cpus": os.cpu_count(), "rows": args.rows, "threads": args.threads}))


if __name__ == "__main__":
    main()
