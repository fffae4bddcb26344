"""``kiln bench offline`` on a tiny random Qwen3-MoE (SmolLM2's tokenizer) with ``--ep 2`` on the
CPU: its expert-load table lists both sparse layers, and the loads it records add up to the tokens
the timed run without the cache computed times the router's top-k."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from tests.support.hf_models import CONFIGS, make_hf_model

TOP_K = CONFIGS["qwen3_moe"][2]["num_experts_per_tok"]


def test_offline_bench_reports_tokens_per_expert(smollm2_dir, tmp_path):
    source = make_hf_model("qwen3_moe", tmp_path / "src", vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(smollm2_dir / name, source / name)
    out = tmp_path / "offline.json"
    result = subprocess.run(
        [sys.executable, "-m", "kiln", "bench", "offline", "--model", str(source), "--device", "cpu", "--ep", "2",
         "--num-requests", "2", "--prefix-words", "8", "--question-words", "3", "--output-len", "3",
         "--max-seq-len", "128", "--max-batch-tokens", "128", "--kv-cache-tokens", "2048", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "KILN_HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "# expert load: tokens per expert per sparse layer (ep=2)" in result.stdout
    assert "| layer | routed tokens | max / mean | tokens per expert |" in result.stdout
    uncached = json.loads(out.read_text())["results"][1]
    computed = uncached["prompt_tokens"] + uncached["output_tokens"] - uncached["requests"]  # last tokens are not fed
    loads = uncached["expert_load"]
    assert sorted(loads) == ["0", "1"] and all(sum(counts) == TOP_K * computed for counts in loads.values())
