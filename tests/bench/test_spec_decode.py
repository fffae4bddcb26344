"""bench/spec_decode.py on the CPU at a tiny shape: the oracle draft proposes the target's own greedy
tokens (every draft accepted), n-gram drafts run in the same bench, and every speculative run's
tokens equal plain decoding's (the bench checks; a mismatch raises). No timings are asserted."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from spec_decode import OracleDrafter, main  # noqa: E402


def test_oracle_proposes_the_recorded_continuation():
    oracle = OracleDrafter([[1, 2, 3, 4, 5, 6], [1, 9, 9]], num_draft_tokens=3)
    assert oracle.propose([1, 2, 3]) == [4, 5, 6]
    assert oracle.propose([1, 2, 3, 4, 5], limit=2) == [6]
    assert oracle.propose([1, 9]) == [9]
    assert oracle.propose([7]) == []


def test_bench_runs_oracle_and_ngram_on_a_tiny_shape(tmp_path, capsys):
    out = tmp_path / "spec.json"
    assert main(["--shape", "smollm2-135m", "--layers", "1", "--vocab-size", "512", "--prompt-len", "16",
                 "--new-tokens", "24", "--draft-tokens", "4", "--device", "cpu", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["drafter"], r["draft_tokens"]) for r in rows] == [("plain", None), ("oracle", 4), ("ngram", 4)]
    oracle = rows[1]
    # Every draft accepted: 5 tokens a verify step, but where max_new_tokens cuts the last chain.
    assert oracle["mean_accept_length"] > 4
    assert oracle["decode_steps"] < rows[0]["decode_steps"] / 3
