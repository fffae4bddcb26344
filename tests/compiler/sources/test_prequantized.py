"""Pre-quantized HF checkpoints (kiln.compiler.sources.prequantized), written here from random weights in
the layouts HF's fp8 and llm-compressor's compressed-tensors write them.

Two kinds of check. Exactness: each checkpoint weight, fused and compiled, reads back as exactly what
its stored values times its scales (per tensor, per channel, per 128x128 block) give, computed here
independently. Tokens: a checkpoint whose weights kiln's own ``--quantization`` would quantize to the
same values (every row of every 128-column block reaches the tensor's largest magnitude, so a
per-tensor, per-block and per-channel scale coincide) gives the same logits, bit for bit, and the same
greedy tokens, as kiln quantizing the plain weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln import Engine, SamplingParams
from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.compiler.sources.hf import SourceError, load_hf_dir
from kiln.compiler.sources.prequantized import PrequantizedTensors
from kiln.ir.serialize import loads
from kiln.kernels.quantize import dequantize
from kiln.runtime.artifact import load_artifact
from kiln.runtime.worker.executor import Executor
from tests.support.hf_models import make_hf_model
from tests.support.stepping import PagedRun

FP8, FP8_MAX = torch.float8_e4m3fn, torch.finfo(torch.float8_e4m3fn).max
SMALL = dict(page_size=4, max_batch_tokens=32, max_logit_rows=32, max_seq_len=64, max_batch_size=4)
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7]]
GEMMS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

FP8_TENSOR = {"quant_method": "fp8", "activation_scheme": "dynamic"}
FP8_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}


def _compressed(kind: str, strategy: str, activations: bool, group_size: int | None = None) -> dict:
    """A compressed-tensors quantization_config as llm-compressor writes it (W8A8 FP8/INT8, or W8A16)."""
    weights = {"num_bits": 8, "type": kind, "symmetric": True, "strategy": strategy, "group_size": group_size,
               "dynamic": False, "observer": "minmax", "actorder": None, "block_structure": None}
    inputs = {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "token", "dynamic": True,
              "group_size": None, "observer": None} if activations else None
    return {"quant_method": "compressed-tensors", "format": f"{kind}-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                          "output_activations": None}}}


def _blocks(w: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """``w`` [R, C] as [R/rows, C/columns, rows, columns] blocks, R padded with zero rows."""
    pad = -w.shape[0] % rows
    w = torch.cat([w, w.new_zeros(pad, w.shape[1])])
    return w.reshape(w.shape[0] // rows, rows, -1, columns).transpose(1, 2)


def _quantize_like_hf(w: torch.Tensor, layout: str, scale_dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored, scale) of ``w`` as the checkpoint writes them; ``layout`` is fp8_tensor, fp8_block,
    fp8_channel, int8_channel, int8_tensor or int8_group32."""
    kind, strategy = layout.split("_")
    limit = FP8_MAX if kind == "fp8" else 127.0

    def encode(x, scale):
        scaled = (x / scale).clamp(-limit, limit)
        return scaled.to(FP8) if kind == "fp8" else scaled.round().to(torch.int8)

    if strategy == "tensor":
        scale = (w.abs().amax() / limit).to(scale_dtype)
        return encode(w, scale.float()), scale.reshape(1)
    if strategy == "channel":
        scale = (w.abs().amax(dim=1, keepdim=True) / limit).to(scale_dtype)
        return encode(w, scale.float()), scale
    if strategy == "group32":
        groups = w.reshape(w.shape[0], -1, 32)
        scale = (groups.abs().amax(dim=-1) / limit).to(scale_dtype)
        return encode(groups, scale.float()[..., None]).reshape(w.shape), scale
    blocks = _blocks(w, 128, 128)
    scale = (blocks.abs().amax(dim=(-1, -2)) / limit).to(scale_dtype)
    return encode(w, _block_scales_per_element(scale.float(), w.shape)), scale


def _block_scales_per_element(scale: torch.Tensor, shape) -> torch.Tensor:
    return scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]


def _dequantize_like_hf(stored: torch.Tensor, scale: torch.Tensor, layout: str) -> torch.Tensor:
    """What the checkpoint's weight is, written out independently of kiln."""
    values, scale = stored.float(), scale.float()
    if layout.endswith("_tensor"):
        return values * scale.reshape(())
    if layout.endswith("_channel"):
        return values * scale.reshape(-1, 1)
    if layout.endswith("_group32"):
        return (values.reshape(values.shape[0], -1, 32) * scale[..., None]).reshape(values.shape)
    return values * _block_scales_per_element(scale, values.shape)


def _reach_the_max(w: torch.Tensor) -> torch.Tensor:
    """``w`` with every row of every 128-column block holding the tensor's largest magnitude once (in
    that row's own largest element), so per-tensor, per-block and per-channel scales are all equal."""
    top = w.abs().amax()
    blocks = w.clone().reshape(w.shape[0], -1, 128)
    where = blocks.abs().argmax(dim=-1, keepdim=True)
    blocks.scatter_(-1, where, top * torch.sign(blocks.gather(-1, where)))
    return blocks.reshape(w.shape)


def _is_gemm(name: str) -> bool:
    return any(f".{g}.weight" in name for g in GEMMS)


def _write_checkpoint(plain: Path, out: Path, layout: str, quantization_config: dict, scale_name: str = "weight_scale",
                      scale_dtype=torch.float32, equalize: bool = False) -> tuple[Path, dict[str, torch.Tensor]]:
    """The model in ``plain`` as a pre-quantized checkpoint in ``out``; with ``equalize``, its plain
    weights are first rewritten (in place) by ``_reach_the_max``. Returns the checkpoint's directory and
    each GEMM weight dequantized independently."""
    tensors = load_file(plain / "model.safetensors")
    if equalize:
        tensors = {n: _reach_the_max(t) if _is_gemm(n) else t for n, t in tensors.items()}
        save_file(tensors, str(plain / "model.safetensors"), metadata={"format": "pt"})
    written, expected = {}, {}
    for name, tensor in tensors.items():
        if not _is_gemm(name):
            written[name] = tensor
            continue
        stored, scale = _quantize_like_hf(tensor, layout, scale_dtype)
        written[name], written[name.removesuffix("weight") + scale_name] = stored, scale
        expected[name] = _dequantize_like_hf(stored, scale, layout)
    out.mkdir()
    save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((plain / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return out, expected


@pytest.fixture
def plain(tmp_path) -> Path:
    """A tiny Llama whose GEMM inputs are whole 128-column blocks; k/v have 64 rows (a partial row block)."""
    return make_hf_model("llama3", tmp_path / "plain", vocab_size=64, hidden_size=128, intermediate_size=256)


# layout, quantization_config, the kiln method the plain model is compared with, the scale tensor's name
CHECKPOINTS = {
    "fp8_tensor": ("fp8_tensor", FP8_TENSOR, "fp8", "weight_scale"),
    "fp8_tensor_inv": ("fp8_tensor", FP8_TENSOR, "fp8", "weight_scale_inv"),
    "fp8_block": ("fp8_block", FP8_BLOCK, "fp8", "weight_scale_inv"),
    "ct_fp8_channel": ("fp8_channel", _compressed("float", "channel", True), "fp8", "weight_scale"),
    "ct_fp8_tensor": ("fp8_tensor", _compressed("float", "tensor", True), "fp8", "weight_scale"),
    "ct_int8_channel": ("int8_channel", _compressed("int", "channel", True), "w8a8_int8", "weight_scale"),
    "ct_int8_tensor": ("int8_tensor", _compressed("int", "tensor", True), "w8a8_int8", "weight_scale"),
    "ct_int8_weight_only": ("int8_channel", _compressed("int", "channel", False), "w8a16_int8", "weight_scale"),
    "ct_int8_group32": ("int8_group32", _compressed("int", "group", False, 32), "w8a16_int8", "weight_scale"),
}


def _logits(artifact: Path) -> torch.Tensor:
    run = PagedRun(Executor(load_artifact(artifact), "cpu"), num_pages=16)
    run.add_sequences(len(PROMPTS))
    return run.step(PROMPTS, all_logits=True)


@pytest.mark.parametrize("case", list(CHECKPOINTS))
def test_compiled_weights_are_exactly_the_checkpoints(plain, tmp_path, case):
    layout, config, _, scale_name = CHECKPOINTS[case]
    # bf16 scales, as llm-compressor often writes them: read as f32, exactly
    checkpoint, expected = _write_checkpoint(plain, tmp_path / "ckpt", layout, config, scale_name, torch.bfloat16)
    source = load_hf_dir(checkpoint)
    assert isinstance(source.tensors, PrequantizedTensors)
    assert not any(name.endswith(scale_name) for name in source.tensors.names())
    artifact = compile_model(checkpoint, tmp_path / "a.kiln", CompileOptions(**SMALL))

    weights = load_file(artifact / "weights" / "rank0.safetensors")
    graph = loads((artifact / "graph.json").read_text())
    layer = "model.layers.1"
    fused = {f"{layer}.self_attn.q_k_v_proj.weight.q": ("q_proj", "k_proj", "v_proj"),
             f"{layer}.mlp.gate_up_proj.weight.q": ("gate_proj", "up_proj"),
             f"{layer}.mlp.down_proj.weight.q": ("down_proj",)}
    for param, parts in fused.items():
        fmt = graph.params[param].format
        read = dequantize(weights[param], tuple(weights[s] for s in fmt.scales), fmt.scheme)
        prefix = "self_attn" if "self_attn" in param else "mlp"
        assert torch.equal(read, torch.cat([expected[f"{layer}.{prefix}.{p}.weight"] for p in parts])), param
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["quantization"]["checkpoint"] == source.quantization.description


@pytest.mark.parametrize("case", ["fp8_tensor", "fp8_block", "ct_fp8_channel", "ct_int8_channel",
                                  "ct_int8_tensor", "ct_int8_weight_only"])
def test_tokens_match_kiln_quantizing_the_same_weights(plain, tmp_path, monkeypatch, case):
    layout, config, method, scale_name = CHECKPOINTS[case]
    checkpoint, _ = _write_checkpoint(plain, tmp_path / "ckpt", layout, config, scale_name, equalize=True)
    ours = compile_model(checkpoint, tmp_path / "pre.kiln", CompileOptions(**SMALL))
    kilns = compile_model(plain, tmp_path / "kiln.kiln", CompileOptions(**SMALL, quantization=method))
    assert torch.equal(_logits(ours), _logits(kilns))

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    greedy = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    tokens = []
    for artifact in (ours, kilns):
        with Engine(str(artifact), device="cpu", kv_cache_tokens=128) as engine:
            tokens.append([engine.generate(p, greedy).token_ids for p in PROMPTS])
    assert tokens[0] == tokens[1]


def test_the_block_scheme_reaches_the_artifact(plain, tmp_path):
    checkpoint, _ = _write_checkpoint(plain, tmp_path / "ckpt", "fp8_block", FP8_BLOCK, "weight_scale_inv")
    graph = (compile_model(checkpoint, tmp_path / "a.kiln", CompileOptions(**SMALL)) / "graph.txt").read_text()
    assert ("param @model.layers.0.self_attn.q_k_v_proj.weight.q: f8e4m3[256, 128] "
            "format=fp8_block128(@model.layers.0.self_attn.q_k_v_proj.weight.q.scale)") in graph
    assert "param @model.layers.0.self_attn.q_k_v_proj.weight.q.scale: f32[256, 1]" in graph
    assert "param @lm_head.weight: bf16[64, 128]" in graph


def test_asking_for_another_quantization_is_refused(plain, tmp_path):
    checkpoint, _ = _write_checkpoint(plain, tmp_path / "ckpt", "fp8_tensor", FP8_TENSOR)
    with pytest.raises(ValueError, match=r"already quantized \(fp8 \(per-tensor scales\)\).*'w8a8_int8'.*give 'fp8'"):
        compile_model(checkpoint, tmp_path / "a.kiln", CompileOptions(**SMALL, quantization="w8a8_int8"))


def _with_config(plain: Path, tmp_path: Path, quantization_config: dict) -> Path:
    config = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return plain


@pytest.mark.parametrize("config,message", [
    ({"quant_method": "awq", "bits": 4}, r"quant_method 'awq' is not supported; supported: quant_method \"fp8\""),
    ({"quant_method": "gptq", "bits": 4}, r"quant_method 'gptq' is not supported"),
    ({**FP8_TENSOR, "activation_scheme": "static"}, r"activation_scheme 'static'.*supported: dynamic"),
    ({**FP8_BLOCK, "weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\].*supported: \[128, 128\]"),
    (_compressed("int", "group", False, 128), r"group_size 128 is not supported; supported: 32"),
    (_compressed("float", "channel", False), r"float8 weight-only is not supported"),
    (_compressed("int", "block", True), r"weight strategy 'block' is not supported; supported: channel, tensor"),
    ({**_compressed("float", "channel", True), "format": "pack-quantized"}, r"format 'pack-quantized'"),
])
def test_unsupported_configs_are_refused_by_name(plain, tmp_path, config, message):
    with pytest.raises(SourceError, match=message):
        load_hf_dir(_with_config(plain, tmp_path, config))


def test_a_scale_that_does_not_fit_is_named(plain, tmp_path):
    checkpoint, _ = _write_checkpoint(plain, tmp_path / "ckpt", "fp8_channel", FP8_TENSOR)  # per-channel scales
    with pytest.raises(SourceError, match=r"q_proj\.weight \[128, 128\] has a scale of shape \[128, 1\]"):
        compile_model(checkpoint, tmp_path / "a.kiln", CompileOptions(**SMALL))
