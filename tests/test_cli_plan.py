"""``kiln plan`` as a user runs it: the plan and its reasons printed, ``--json``, and an impossible
request exiting non-zero with the reasons."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.planner.configs import LLAMA3_70B, LLAMA31_405B

REPO = Path(__file__).resolve().parents[1]


def kiln_plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln", "plan", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)


@pytest.fixture
def model_dir(tmp_path):
    def write(config: dict) -> str:
        directory = tmp_path / str(len(list(tmp_path.iterdir())))
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(config))
        return str(directory)
    return write


def test_plan_prints_the_choice_and_the_numbers_behind_it(model_dir):
    done = kiln_plan(model_dir(LLAMA3_70B), "--gpus", "8")
    print(done.stdout)
    assert done.returncode == 0, done.stderr
    assert "plan: tp=4 pp=1 ep=1 dp=2" in done.stdout
    assert "not tp=2 pp=1: weights 70.6 GB a rank exceed the 68.0 GB usable" in done.stdout
    assert "weights   35.28 GB  (bf16, 2 B a value)" in done.stdout
    assert "81,920 B a token" in done.stdout and "all-reduce 2.62 MB a step" in done.stdout
    assert "kiln serve --dp 2" in done.stdout


def test_plan_json_is_machine_readable(model_dir):
    done = kiln_plan(model_dir(LLAMA3_70B), "--gpus", "8", "--gpu", "h200", "--max-seq-len", "4096",
                     "--concurrency", "16", "--quantization", "fp8", "--json")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["feasible"] and (plan["tp"], plan["pp"], plan["dp"]) == (1, 1, 8)
    assert plan["requested_kv_tokens"] == 4096 * 16 <= plan["kv_tokens"]
    assert plan["assumptions"]["memory_bandwidth"] == 4.8e12


def test_an_impossible_request_exits_non_zero_with_the_reasons(model_dir):
    path = model_dir(LLAMA31_405B)
    done = kiln_plan(path, "--gpus", "2")
    print(done.stderr)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith("kiln: error: LlamaForCausalLM does not fit on 2 x H100 SXM 80GB")
    assert "tp=2 pp=1: weights 405.9 GB a rank exceed the 68.0 GB usable" in done.stderr
    as_json = kiln_plan(path, "--gpus", "2", "--json")
    assert as_json.returncode == 2 and json.loads(as_json.stdout)["feasible"] is False
    missing = kiln_plan(str(Path(path).parent / "nope"))
    assert missing.returncode == 2 and "no such artifact, model directory, GGUF file or alias" in missing.stderr
