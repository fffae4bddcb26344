"""bench/lora_decode.py on the CPU with a small shape: its adapters load (checked like any PEFT
adapter), every run decodes, and it reports the overhead rows the GPU run reports."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import lora_decode  # noqa: E402


def test_lora_decode_runs_on_a_small_shape(tmp_path):
    out = tmp_path / "lora.json"
    results = lora_decode.main(["--device", "cpu", "--shape", "smollm2-135m", "--layers", "1", "--vocab-size", "512",
                                "--batches", "1", "3", "--adapters", "2", "--rank", "4", "--prompt-len", "8",
                                "--new-tokens", "3", "--out", str(out), "--kernel-config", "lora_max_splits=2"])
    assert json.loads(out.read_text()) == results
    assert results["kernel_config"] == {"lora_max_splits": 2}
    assert [row["batch"] for row in results["rows"]] == [1, 3]
    for row in results["rows"]:
        assert all(value > 0 for key, value in row.items() if key.endswith("ms/step"))
        assert "overhead" in row and "hooks overhead" in row
