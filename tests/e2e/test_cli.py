"""The command line end to end with the real SmolLM2: ``kiln compile``, then ``generate`` and
``chat`` (one-shot and interactive on stdin) against the artifact, and ``kiln bench`` dispatch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.hf_models import make_hf_model

REPO = Path(__file__).resolve().parents[2]


def kiln(*args: str, stdin: str | None = None, home: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    if home is not None:
        env["KILN_HOME"] = str(home)
    return subprocess.run([sys.executable, "-m", "kiln", *args], input=stdin, capture_output=True, text=True,
                          env=env, timeout=600)


@pytest.fixture(scope="module")
def artifact(smollm2_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "smol.kiln"
    result = kiln("compile", str(smollm2_dir), "-o", str(out), "--dtype", "fp32", "--max-seq-len", "1024",
                  "--backend", "torch")
    assert result.returncode == 0, result.stderr
    assert f"wrote {out}" in result.stdout
    return out


def test_compile_takes_a_kernel_config_and_skipped_passes(tmp_path):
    source = make_hf_model("llama3", tmp_path / "src")
    out = tmp_path / "m.kiln"
    result = kiln("compile", str(source), "-o", str(out), "--dtype", "fp32", "--backend", "torch",
                  "--kernel-config", "pdl=false", "--kernel-config", "gemv_block_k=(64,2048)", "--skip-pass", "dce")
    assert result.returncode == 0, result.stderr
    options = json.loads((out / "manifest.json").read_text())["options"]
    assert options["skip_passes"] == ["dce"]
    assert options["kernel_config"]["pdl"] is False and options["kernel_config"]["gemv_block_k"] == [64, 2048]
    typo = kiln("compile", str(source), "-o", str(tmp_path / "typo.kiln"), "--kernel-config", "decode_blok_n=32")
    assert typo.returncode == 2 and "Traceback" not in typo.stderr
    assert "no field 'decode_blok_n'; fields: pdl, side_stream, decode_min_split_tokens" in typo.stderr
    unknown = kiln("compile", str(source), "-o", str(tmp_path / "unknown.kiln"), "--skip-pass", "fuse_everything")
    assert unknown.returncode == 2 and "no such pass; passes: verify, expose_hidden_states, tree_attention, shard_tp, split_pipeline, place_experts, shard_ep, count_expert_load, fuse_router_count, fuse_linears" in unknown.stderr


def test_compile_takes_a_quantization(tmp_path):
    source = make_hf_model("llama3", tmp_path / "src")
    out = tmp_path / "m.kiln"
    result = kiln("compile", str(source), "-o", str(out), "--backend", "torch", "--quantization", "w8a8_int8")
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "manifest.json").read_text())["options"]["quantization"] == "w8a8_int8"
    unknown = kiln("compile", str(source), "-o", str(tmp_path / "q4.kiln"), "--quantization", "q4_k")
    assert unknown.returncode == 2 and "Traceback" not in unknown.stderr
    assert "unknown quantization 'q4_k'; supported: fp8, w8a8_int8, w8a16_int8, mxfp4" in unknown.stderr
    head = tmp_path / "head.kiln"
    result = kiln("compile", str(source), "-o", str(head), "--backend", "torch", "--quantization", "fp8",
                  "--quantize-lm-head")
    assert result.returncode == 0, result.stderr
    assert json.loads((head / "manifest.json").read_text())["options"]["quantize_lm_head"] is True
    graph = (head / "graph.txt").read_text()
    assert "param @lm_head.weight.q: f8e4m3" in graph and "param @lm_head.weight:" not in graph
    alone = kiln("compile", str(source), "-o", str(tmp_path / "alone.kiln"), "--quantize-lm-head")
    assert alone.returncode == 2 and "Traceback" not in alone.stderr
    assert "quantize_lm_head: the lm_head is quantized by the model's quantization method, and none was given" \
        in alone.stderr


def test_quantize_lm_head_takes_a_prequantized_checkpoints_method(tmp_path):
    # The checkpoint's GEMMs arrive quantized and its lm_head plain: the head gets the checkpoint's method.
    from tests.compiler.sources.test_prequantized import FP8_TENSOR, _write_checkpoint

    source = make_hf_model("llama3", tmp_path / "src", vocab_size=64, hidden_size=128, intermediate_size=256)
    checkpoint, _ = _write_checkpoint(source, tmp_path / "fp8", "fp8_tensor", FP8_TENSOR)
    out = tmp_path / "head.kiln"
    result = kiln("compile", str(checkpoint), "-o", str(out), "--backend", "torch", "--quantize-lm-head")
    assert result.returncode == 0, result.stderr
    graph = (out / "graph.txt").read_text()
    assert "param @lm_head.weight.q: f8e4m3[64, 128] format=fp8_channel" in graph
    assert "param @lm_head.weight:" not in graph


def test_compile_takes_max_logit_rows_for_speculation(tmp_path):
    source = make_hf_model("llama3", tmp_path / "src")
    out = tmp_path / "m.kiln"
    result = kiln("compile", str(source), "-o", str(out), "--backend", "torch", "--max-batch-size", "8",
                  "--max-logit-rows", "40")
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "manifest.json").read_text())["runtime"]["symbol_bounds"]["N"] == 40


def test_compile_takes_a_tp(tmp_path):
    source = make_hf_model("llama3", tmp_path / "src")
    out = tmp_path / "m.kiln"
    result = kiln("compile", str(source), "-o", str(out), "--backend", "torch", "--tp", "2")
    assert result.returncode == 0, result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["options"]["tp"] == manifest["runtime"]["tp"] == 2
    assert manifest["weights"] == ["weights/rank0.safetensors", "weights/rank1.safetensors"]
    assert all((out / name).is_file() for name in manifest["weights"])
    assert "placement=column(0)" in (out / "graph.txt").read_text()
    uneven = kiln("compile", str(source), "-o", str(tmp_path / "tp3.kiln"), "--tp", "3")
    assert uneven.returncode == 2 and "Traceback" not in uneven.stderr
    assert "tp=3 must divide the attention heads (4 in l0.attn); possible: 1, 2, 4" in uneven.stderr


def test_compile_takes_a_pp_with_a_tp(tmp_path):
    source = make_hf_model("llama3", tmp_path / "src")
    out = tmp_path / "m.kiln"
    result = kiln("compile", str(source), "-o", str(out), "--backend", "torch", "--tp", "2", "--pp", "2")
    assert result.returncode == 0, result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["options"]["pp"] == manifest["runtime"]["pp"] == 2
    assert manifest["weights"] == [f"weights/rank{rank}.safetensors" for rank in range(4)]
    assert [stage["dir"] for stage in manifest["stages"]] == ["stages/0", "stages/1"]
    assert 'send(%l0.resid_mlp) {group="pp", peer=1}' in (out / "stages/0/graph.txt").read_text()
    too_many = kiln("compile", str(source), "-o", str(tmp_path / "pp3.kiln"), "--pp", "3")
    assert too_many.returncode == 2 and "Traceback" not in too_many.stderr
    assert "pp=3: the model has 2 decoder layers, fewer than the stages; pp may be at most 2" in too_many.stderr


def test_compile_takes_tp_auto_with_gpu_hints(tmp_path):
    """The planner chooses (tests/planner/test_auto.py): f32 weights and KV of this model need two
    ranks of 0.0004 GB."""
    source = make_hf_model("llama3", tmp_path / "src")
    out = tmp_path / "m.kiln"
    result = kiln("compile", str(source), "-o", str(out), "--backend", "torch", "--dtype", "fp32", "--max-seq-len",
                  "64", "--tp", "auto", "--gpus", "2", "--gpu-memory-gb", "0.0004")
    assert result.returncode == 0, result.stderr
    assert "kiln: tp=auto: tp=2, pp=1 for 2 GPU(s) of 0.0004 GB: tp=2 pp=1: the smallest layout" in result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["runtime"]["tp"], manifest["runtime"]["pp"]) == (2, 1)
    wrong = kiln("compile", str(source), "-o", str(tmp_path / "x.kiln"), "--tp", "some")
    assert wrong.returncode == 2 and "--tp must be a number of ranks or 'auto', got 'some'" in wrong.stderr

def test_compile_takes_a_kv_cache_dtype_and_refuses_requantizing(tmp_path):
    from tests.compiler.sources.test_prequantized import FP8_TENSOR, _write_checkpoint

    source = make_hf_model("llama3", tmp_path / "src", vocab_size=64, hidden_size=128, intermediate_size=256)
    out = tmp_path / "kv8.kiln"
    result = kiln("compile", str(source), "-o", str(out), "--backend", "torch", "--kv-cache-dtype", "fp8_e4m3")
    assert result.returncode == 0, result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["options"]["kv_cache_dtype"] == "fp8_e4m3" and manifest["runtime"]["kv_cache_dtype"] == "f8e4m3"
    wrong = kiln("compile", str(source), "-o", str(tmp_path / "x.kiln"), "--kv-cache-dtype", "fp8_e5m2")
    assert wrong.returncode == 2 and "--kv-cache-dtype: invalid choice: 'fp8_e5m2'" in wrong.stderr
    assert "fp8_e4m3" in wrong.stderr.splitlines()[-1]
    checkpoint, _ = _write_checkpoint(source, tmp_path / "fp8", "fp8_tensor", FP8_TENSOR)
    again = kiln("compile", str(checkpoint), "-o", str(tmp_path / "y.kiln"), "--quantization", "mxfp4")
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert "already quantized (fp8 (per-tensor scales)); quantization 'mxfp4' would requantize it" in again.stderr


def test_chat_one_shot(artifact):
    result = kiln("chat", str(artifact), "--prompt", "What is the capital of France?", "--max-new-tokens", "30",
                  "--kv-cache-tokens", "4096")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_chat_reads_turns_from_piped_stdin(artifact):
    result = kiln("chat", str(artifact), "--max-new-tokens", "30", "--kv-cache-tokens", "4096",
                  stdin="What is the capital of France?\n")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_generate_with_stop_string(artifact):
    result = kiln("generate", str(artifact), "--prompt", "The capital of France is", "--max-new-tokens", "20",
                  "--stop", ".", "--kv-cache-tokens", "4096")
    assert result.returncode == 0, result.stderr
    assert "." not in result.stdout.strip()


def test_generate_with_ngram_speculation_prints_the_plain_text(artifact):
    prompt = ["--prompt", "Count: 1, 2, 3, 4, 5, 6,", "--max-new-tokens", "12", "--kv-cache-tokens", "4096"]
    plain = kiln("generate", str(artifact), *prompt)
    ours = kiln("generate", str(artifact), *prompt, "--speculative-algorithm", "ngram",
                "--speculative-num-draft-tokens", "3", "--speculative-ngram-max-match-window-size", "4")
    assert ours.returncode == 0, ours.stderr
    assert ours.stdout == plain.stdout


def test_bad_sampling_option_is_one_line(artifact):
    result = kiln("generate", str(artifact), "--prompt", "x", "--top-p", "2")
    assert result.returncode == 2 and "top_p" in result.stderr and "Traceback" not in result.stderr


def test_bench_dispatch():
    result = kiln("bench", "no-such-bench")
    assert result.returncode == 2 and "unknown benchmark 'no-such-bench'" in result.stderr
    available = result.stderr.split("available: ", 1)[1].strip().split(", ")
    assert set(available) == {"decode", "disagg", "kernels", "lora_decode", "moe_decode", "offline", "serving",
                              "spec_decode", "startup", "structured"}, "helpers and experiments are not"
    result = kiln("bench", "offline", "--help")
    assert result.returncode == 0 and "--prefix-words" in result.stdout
    # `kernels` names bench/kernel_bench.py (a bench module named kernels would shadow a package).
    result = kiln("bench", "kernels", "--help")
    assert result.returncode == 0 and "--only" in result.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the refusal is for a machine without a GPU")
def test_compile_warm_without_a_gpu_is_refused_before_compiling(tmp_path):
    source = make_hf_model("llama3", tmp_path / "src")
    result = kiln("compile", str(source), "-o", str(tmp_path / "m.kiln"), "--warm")
    assert result.returncode == 2 and "--warm compiles the Triton kernels for this machine's GPU" in result.stderr
    assert not (tmp_path / "m.kiln").exists()
