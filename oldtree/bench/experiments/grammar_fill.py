"""How fast xgrammar fills a step's grammar masks, by grammar position and by thread count.

A constrained decode step at batch 64 fills 64 bitmask rows (``GrammarState.fill_bitmasks``: xgrammar's
``BatchGrammarMatcher`` on its own threads) while the host does the step's other work; on an H100 the
fill outlasted that work by 384 us a step (``bench/structured.py``, session 27). This times, on the
host it runs on (no GPU needed), one row's fill at several positions in a JSON schema's output, and a
batch of rows filled by ``BatchGrammarMatcher`` with each thread count and by a Python thread pool
whose threads each fill a run of rows (``GrammarMatcher.fill_next_token_bitmask`` per row): what the
fill costs and how much more threads buy.

    python bench/experiments/grammar_fill.py --tokenizer-dir .bench-tokenizer --rows 64 --threads 1 2 4 8 15
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xgrammar
from transformers import AutoTokenizer

BENCH = Path(__file__).resolve().parent.parent
# Outputs cut at a grammar position each: between fields, inside a string, inside an array's string.
POSITIONS = {"start": "", "in a string": '{"name": "John Sm', "after a number": '{"name": "Jo", "age": 3',
             "in an array's string": '{"name": "Jo", "age": 33, "hobbies": ["rea'}


def matchers_at(grammar: xgrammar.CompiledGrammar, token_ids: list[int], rows: int) -> list[xgrammar.GrammarMatcher]:
    matchers = []
    for _ in range(rows):
        matcher = xgrammar.GrammarMatcher(grammar)
        for token_id in token_ids:
            if not matcher.accept_token(token_id):
                raise SystemExit(f"the schema does not admit the text's token {token_id}")
        matchers.append(matcher)
    return matchers


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
    columns = " | ".join(f"batch, {t} threads | pool, {t} threads" for t in args.threads)
    print(f"| position | one row | {columns} |")
    print("|---|---:|" + "---:|---:|" * len(args.threads))
    for label, text in POSITIONS.items():
        matchers = matchers_at(grammar, tokenizer.encode(text, add_special_tokens=False), args.rows)
        one_row = timed_us(lambda: matchers[0].fill_next_token_bitmask(mask, 0), args.repeats)
        cells = []
        for threads in args.threads:
            batch = xgrammar.BatchGrammarMatcher(threads)
            cells.append(timed_us(lambda: batch.batch_fill_next_token_bitmask(matchers, mask, rows), args.repeats))
            runs = [rows[i::threads] for i in range(threads)]

            def fill_run(run: list[int]) -> None:
                for row in run:
                    matchers[row].fill_next_token_bitmask(mask, row)

            with ThreadPoolExecutor(threads) as pool:
                cells.append(timed_us(lambda: list(pool.map(fill_run, runs)), args.repeats))
        print(f"| {label} | {one_row:.1f} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")
    print(json.dumps({"cpus": os.cpu_count(), "rows": args.rows, "threads": args.threads}))


if __name__ == "__main__":
    main()
