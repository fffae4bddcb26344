"""kiln.compiler.sources.gguf: a GGUF file -> an HF-layout directory.

The real SmolLM2 GGUF is checked against transformers' own GGUF loader (every tensor bit for bit,
the config fields) and run end to end; small GGUFs written here check the q/k un-permutation on a
known HF model and the errors for files the converter cannot read.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Mapping

import numpy as np
import pytest
import torch
import gguf
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from safetensors.torch import load_file

from kiln import Engine, SamplingParams
from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.compiler.sources.aliases import locate_gguf
from kiln.compiler.sources.gguf import convert_gguf
from kiln.compiler.sources.hf import SourceError
from tests.support.hf_models import hf_greedy

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def reference_model():
    """SmolLM2 as transformers loads it from the GGUF: its own dequantization and un-permutation."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF model")
    gguf_path = locate_gguf("smollm2-135m-instruct")
    return transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


def test_every_tensor_matches_transformers_bit_for_bit(smollm2_dir: Path, reference_model) -> None:
    ours = load_file(smollm2_dir / "model.safetensors")
    reference = reference_model.state_dict()
    # The embeddings are tied: transformers lists lm_head.weight as the same tensor, kiln omits it.
    assert set(ours) == set(reference) - {"lm_head.weight"}
    assert reference["lm_head.weight"].data_ptr() == reference["model.embed_tokens.weight"].data_ptr()
    assert {tensor.dtype for tensor in ours.values()} == {torch.float32}
    differing = [name for name, tensor in ours.items()
                 if tensor.shape != reference[name].shape
                 or not torch.equal(tensor.view(torch.int32), reference[name].view(torch.int32))]
    assert differing == []


def _rope_theta(config) -> float:
    # transformers 5 folds rope_theta into rope_parameters; older versions keep the attribute
    parameters = getattr(config, "rope_parameters", None) or {}
    return parameters.get("rope_theta") or config.rope_theta


def test_config_agrees_with_transformers(smollm2_dir: Path, reference_model) -> None:
    ours = transformers.AutoConfig.from_pretrained(smollm2_dir)
    reference = reference_model.config
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
                  "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act", "model_type"):
        assert getattr(ours, field) == getattr(reference, field), field
    assert np.float32(ours.rms_norm_eps) == np.float32(reference.rms_norm_eps)
    assert _rope_theta(ours) == _rope_theta(reference)

    written = json.loads((smollm2_dir / "config.json").read_text())
    assert written["architectures"] == ["LlamaForCausalLM"]
    assert written["torch_dtype"] == "float32"
    assert written["rms_norm_eps"] == 1e-05  # the float32 metadata value, written as its shortest decimal
    assert (written["num_hidden_layers"], written["num_key_value_heads"], written["head_dim"]) == (30, 3, 64)


def test_converted_model_answers_paris(smollm2_dir: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(smollm2_dir / "tokenizer.json"))
    chat_template = json.loads((smollm2_dir / "tokenizer_config.json").read_text())["chat_template"]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           chat_template=chat_template, tokenize=False, add_generation_prompt=True)
    input_ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        output = model.generate(input_ids, max_new_tokens=20, do_sample=False, eos_token_id=2, pad_token_id=2)
    answer = tokenizer.decode(output[0, input_ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


# ---- small GGUFs written here -------------------------------------------------------------------

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=40, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0)


def _permute_like_llama_cpp(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows (i, i + d/2) become adjacent pairs."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]) \
        .swapaxes(1, 2).reshape(weight.shape)


def _write_gguf(path: Path, tensors: Mapping[str, np.ndarray], arch: str = "llama",
                raw_types: Mapping[str, GGMLQuantizationType] | None = None) -> Path:
    writer = GGUFWriter(path, arch)
    writer.add_block_count(TINY["num_hidden_layers"])
    writer.add_context_length(TINY["max_position_embeddings"])
    writer.add_embedding_length(TINY["hidden_size"])
    writer.add_feed_forward_length(TINY["intermediate_size"])
    writer.add_head_count(TINY["num_attention_heads"])
    writer.add_head_count_kv(TINY["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(TINY["rms_norm_eps"])
    writer.add_rope_freq_base(TINY["rope_theta"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(["<|endoftext|>"] + [f"t{i}" for i in range(TINY["vocab_size"] - 1)])
    writer.add_token_types([3] + [1] * (TINY["vocab_size"] - 1))
    writer.add_token_merges([])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    for name, array in tensors.items():
        writer.add_tensor(name, array, raw_dtype=(raw_types or {}).get(name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# llama.cpp's names for the HF llama's tensors, written out here independently of kiln's table
GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
GGUF_LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                    "mlp.down_proj": "ffn_down"}


def _gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", hf_name)
    return f"blk.{match[1]}.{GGUF_LAYER_NAMES[match[2]]}.weight"


def _gguf_tensors_of(model) -> dict[str, np.ndarray]:
    """An HF llama's weights under GGUF names, q/k permuted as llama.cpp stores them."""
    heads = {"q_proj": TINY["num_attention_heads"], "k_proj": TINY["num_key_value_heads"]}
    tensors = {}
    for hf_name, tensor in model.state_dict().items():
        array = tensor.numpy().copy()
        for projection, head_count in heads.items():
            if projection in hf_name:
                array = _permute_like_llama_cpp(array, head_count)
        tensors[_gguf_name(hf_name)] = array
    return tensors


@pytest.fixture(scope="module")
def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config).eval()


def test_unpermutes_q_and_k_back_to_the_hf_model(tmp_path: Path, tiny_llama) -> None:
    gguf_path = _write_gguf(tmp_path / "tiny.gguf", _gguf_tensors_of(tiny_llama))
    out = convert_gguf(gguf_path, tmp_path / "hf")

    converted = load_file(out / "model.safetensors")
    original = tiny_llama.state_dict()
    assert set(converted) == set(original)  # untied: lm_head.weight comes from output.weight
    assert all(torch.equal(converted[name], original[name]) for name in original)

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.arange(12).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, tiny_llama(tokens).logits)


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    gguf_path = _write_gguf(tmp_path / "mamba.gguf", {}, arch="mamba")
    with pytest.raises(SourceError, match=r"mamba\.gguf.*architecture 'mamba'.*supported: llama"):
        convert_gguf(gguf_path, tmp_path / "out")


def test_unsupported_quant_type_is_named(tmp_path: Path) -> None:
    # Q8_1 is llama.cpp's activation format: it has a block layout, but gguf-py cannot dequantize it
    block_values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_1]
    rows, columns = 8, 64
    tensors = {"token_embd.weight": np.zeros((rows, columns // block_values * block_bytes), dtype=np.uint8)}
    gguf_path = _write_gguf(tmp_path / "q81.gguf", tensors, raw_types={"token_embd.weight": GGMLQuantizationType.Q8_1})
    with pytest.raises(SourceError, match=r"q81\.gguf.*'token_embd\.weight'.*Q8_1.*supported: .*Q4_1"):
        convert_gguf(gguf_path, tmp_path / "out")


def test_tensor_without_hf_name_is_named(tmp_path: Path) -> None:
    gguf_path = _write_gguf(tmp_path / "extra.gguf", {"rope_freqs.weight": np.ones(16, dtype=np.float32)})
    with pytest.raises(SourceError, match=r"extra\.gguf.*'rope_freqs\.weight'"):
        convert_gguf(gguf_path, tmp_path / "out")


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nothing\.gguf"):
        convert_gguf(tmp_path / "nothing.gguf", tmp_path / "out")


def test_non_gguf_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "weights.gguf").write_bytes(b"PK\x03\x04 a zip, not a gguf")
    with pytest.raises(SourceError, match=r"weights\.gguf: not a GGUF file"):
        convert_gguf(tmp_path / "weights.gguf", tmp_path / "out")


def test_truncated_gguf_is_named(tmp_path: Path) -> None:
    real = locate_gguf("smollm2-135m-instruct")
    with open(real, "rb") as f:
        (tmp_path / "cut.gguf").write_bytes(f.read(4096))
    with pytest.raises(SourceError, match=r"cut\.gguf: corrupt or truncated GGUF"):
        convert_gguf(tmp_path / "cut.gguf", tmp_path / "out")


# ---- Q8_0 stays int8 ----------------------------------------------------------------------------

def _q8_0_model(tiny_llama) -> tuple[dict[str, np.ndarray], dict[str, torch.Tensor]]:
    """The tiny llama's tensors under GGUF names with every layer GEMM weight as Q8_0 bytes, and the HF
    state dict those bytes decode to (gguf-py's own quantizer and dequantizer; Q8_0 blocks run along a
    row, so quantizing llama.cpp's permuted rows and un-permuting equals quantizing HF's rows)."""
    tensors = _gguf_tensors_of(tiny_llama)
    decoded = {}
    for hf_name, tensor in tiny_llama.state_dict().items():
        name = _gguf_name(hf_name)
        if hf_name.startswith("model.layers.") and tensor.dim() == 2:
            tensors[name] = gguf.quants.quantize(tensors[name], GGMLQuantizationType.Q8_0)
            raw = gguf.quants.quantize(tensor.numpy(), GGMLQuantizationType.Q8_0)
            decoded[hf_name] = torch.from_numpy(gguf.quants.dequantize(raw, GGMLQuantizationType.Q8_0)
                                                .reshape(tensor.shape).astype(np.float32))
    return tensors, decoded


def test_q8_0_layer_weights_stay_int8(tmp_path: Path, tiny_llama) -> None:
    tensors, decoded = _q8_0_model(tiny_llama)
    raw_types = {name: GGMLQuantizationType.Q8_0 for name, a in tensors.items() if a.dtype == np.uint8}
    out = convert_gguf(_write_gguf(tmp_path / "q8.gguf", tensors, raw_types=raw_types), tmp_path / "hf")

    written = load_file(out / "model.safetensors")
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "int-quantized"
    for hf_name, expected in decoded.items():
        values, scales = written[hf_name], written[hf_name + "_scale"]
        assert values.dtype == torch.int8 and scales.shape == (values.shape[0], values.shape[1] // 32)
        blocks = values.float().reshape(values.shape[0], -1, 32) * scales[..., None]
        assert torch.equal(blocks.reshape(values.shape), expected), hf_name
    assert written["lm_head.weight"].dtype == torch.float32  # F32 in this file: dequantized as before

    artifact = compile_model(out, tmp_path / "q8.kiln", CompileOptions(
        dtype="fp32", page_size=4, max_batch_tokens=32, max_batch_size=2, max_seq_len=64))
    graph = (artifact / "graph.txt").read_text()
    assert "param @model.layers.0.mlp.down_proj.weight.q: i8[32, 64] format=int8_block32(" in graph
    assert "param @model.layers.0.mlp.down_proj.weight.q.scale: f32[32, 2]" in graph

    # The model the Q8_0 bytes decode to, in transformers, against kiln reading the int8 weights (f32 compute).
    reference = transformers.LlamaForCausalLM(tiny_llama.config).eval()
    reference.load_state_dict({**tiny_llama.state_dict(), **decoded})
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    with Engine(str(artifact), device="cpu", kv_cache_tokens=64) as engine:
        ours = engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)).token_ids
    assert ours == hf_greedy(reference, prompt, 16)
