"""The GGUF source: a llama.cpp ``.gguf`` file -> an HF-layout model directory.

``convert_gguf`` writes ``config.json``, ``model.safetensors`` (every tensor under its HF name,
dequantized to float32, except the layers' Q8_0 GEMM weights) and the tokenizer files, so the rest of
kiln only ever reads HF directories. Q8_0 GEMM weights (blocks of 32 int8 values sharing an f16 scale)
stay int8: written as a compressed-tensors int8 weight-only checkpoint with groups of 32 (``weight``
int8, ``weight_scale`` f32 per row and group, exactly the f16 scales), which kiln compiles into its
``int8_block32`` format (``prequantized.py``). The embedding and the lm_head, which kiln keeps plain,
are dequantized as every other type is. What is particular to one GGUF architecture -- which metadata key is which config
field, what each tensor is called in HF, which tensors llama.cpp permuted -- is one
``GGUFArchitecture`` entry in ``ARCHITECTURES``; a new architecture is one more entry.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from safetensors.numpy import save_file

from .gguf_tokenizer import write_tokenizer_files
from .hf import SourceError

GGUF_MAGIC = b"GGUF"
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")


@dataclass(frozen=True)
class GGUFArchitecture:
    """How one ``general.architecture`` maps onto an HF model class."""

    hf_architecture: str
    model_type: str
    # metadata key after the "<arch>." prefix -> HF config key
    config_keys: Mapping[str, str]
    # HF config entries the GGUF does not state because llama.cpp hard-codes them for the architecture
    implied_config: Mapping[str, Any]
    # GGUF tensor name -> HF name; per-layer names are written with "{layer}"
    tensor_names: Mapping[str, str]
    # GGUF tensor (per-layer part of the name) -> config key holding its head count: llama.cpp's
    # converter interleaves these rows for its rope, HF rotates each head's two halves
    rope_permuted: Mapping[str, str] = field(default_factory=dict)


LLAMA = GGUFArchitecture(
    hf_architecture="LlamaForCausalLM",
    model_type="llama",
    config_keys={
        "vocab_size": "vocab_size",
        "context_length": "max_position_embeddings",
        "embedding_length": "hidden_size",
        "feed_forward_length": "intermediate_size",
        "block_count": "num_hidden_layers",
        "attention.head_count": "num_attention_heads",
        "attention.head_count_kv": "num_key_value_heads",
        "attention.key_length": "head_dim",
        "attention.layer_norm_rms_epsilon": "rms_norm_eps",
        "rope.freq_base": "rope_theta",
    },
    implied_config={"hidden_act": "silu", "attention_bias": False, "mlp_bias": False},
    tensor_names={
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
        "blk.{layer}.attn_norm.weight": "model.layers.{layer}.input_layernorm.weight",
        "blk.{layer}.attn_q.weight": "model.layers.{layer}.self_attn.q_proj.weight",
        "blk.{layer}.attn_k.weight": "model.layers.{layer}.self_attn.k_proj.weight",
        "blk.{layer}.attn_v.weight": "model.layers.{layer}.self_attn.v_proj.weight",
        "blk.{layer}.attn_output.weight": "model.layers.{layer}.self_attn.o_proj.weight",
        "blk.{layer}.ffn_norm.weight": "model.layers.{layer}.post_attention_layernorm.weight",
        "blk.{layer}.ffn_gate.weight": "model.layers.{layer}.mlp.gate_proj.weight",
        "blk.{layer}.ffn_up.weight": "model.layers.{layer}.mlp.up_proj.weight",
        "blk.{layer}.ffn_down.weight": "model.layers.{layer}.mlp.down_proj.weight",
    },
    rope_permuted={"attn_q.weight": "num_attention_heads", "attn_k.weight": "num_key_value_heads"},
)

ARCHITECTURES: dict[str, GGUFArchitecture] = {"llama": LLAMA}


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Write the HF-layout directory for ``gguf_path`` into ``out_dir`` (created if needed)."""
    gguf_path = Path(gguf_path)
    reader = open_gguf(gguf_path)
    metadata = read_metadata(reader)
    arch = architecture_of(metadata, gguf_path)
    config = hf_config(metadata, arch, {t.name for t in reader.tensors}, gguf_path)
    check_tensor_types(reader, gguf_path)
    tensors = dict(hf_tensors(reader, arch, config, gguf_path))
    if any(name.endswith(".weight_scale") for name in tensors):
        config["quantization_config"] = Q8_0_CONFIG

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer_files(metadata, out_dir, source=gguf_path)
    return out_dir


def has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC


def open_gguf(path: Path) -> GGUFReader:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: GGUF file not found")
    if not has_gguf_magic(path):
        raise SourceError(f"{path}: not a GGUF file (it does not start with {GGUF_MAGIC!r})")
    try:
        return GGUFReader(path)
    except Exception as exc:  # the reader raises several types (ValueError, struct/index errors) on bad data
        raise SourceError(f"{path}: corrupt or truncated GGUF file: {type(exc).__name__}: {exc}") from None


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every metadata key -> its value as plain Python (str, int, float, bool, or a list of them)."""
    return {name: _field_value(f) for name, f in reader.fields.items() if not name.startswith("GGUF.")}


def _field_value(f: gguf.ReaderField) -> Any:
    if f.types[0] == GGUFValueType.ARRAY:
        return [_scalar(f.types[-1], f.parts[index]) for index in f.data]
    return _scalar(f.types[0], f.parts[f.data[0]])


def _scalar(kind: GGUFValueType, part: np.ndarray) -> Any:
    if kind == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    if kind == GGUFValueType.FLOAT32:
        # The shortest decimal that reads back as the same float32, so 1e-5 is written as 1e-05
        # and not as 9.999999747378752e-06; both are the same value once a model computes in f32.
        return float(str(np.float32(part[0])))
    if kind == GGUFValueType.BOOL:
        return bool(part[0])
    return part[0].item()


def architecture_of(metadata: Mapping[str, Any], path: Path) -> GGUFArchitecture:
    name = metadata.get("general.architecture")
    if name not in ARCHITECTURES:
        raise SourceError(f"{path}: GGUF architecture {name!r} is not supported; "
                          f"supported: {', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[name]


def hf_config(metadata: Mapping[str, Any], arch: GGUFArchitecture, tensor_names: set[str],
              path: Path) -> dict[str, Any]:
    prefix = metadata["general.architecture"] + "."
    config: dict[str, Any] = {"architectures": [arch.hf_architecture], "model_type": arch.model_type}
    config.update(arch.implied_config)
    for key, hf_key in arch.config_keys.items():
        if prefix + key in metadata:
            config[hf_key] = metadata[prefix + key]
    for required in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if required not in config:
            gguf_key = prefix + next(k for k, v in arch.config_keys.items() if v == required)
            raise SourceError(f"{path}: metadata key {gguf_key!r} is missing")
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    config.setdefault("vocab_size", len(metadata.get("tokenizer.ggml.tokens", ())))
    _check_rope(metadata, prefix, config["head_dim"], path)
    config["tie_word_embeddings"] = "output.weight" not in tensor_names
    for hf_key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                             ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{gguf_key}" in metadata:
            config[hf_key] = metadata[f"tokenizer.ggml.{gguf_key}"]
    config["torch_dtype"] = "float32"
    return config


def _check_rope(metadata: Mapping[str, Any], prefix: str, head_dim: int, path: Path) -> None:
    """Refuse rope variants the config cannot express, rather than writing a model that runs wrong."""
    rotary = metadata.get(prefix + "rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise SourceError(f"{path}: rope covers {rotary} of {head_dim} head dims; partial rotary is not supported")
    scaling = metadata.get(prefix + "rope.scaling.type", "none")
    if scaling != "none":
        raise SourceError(f"{path}: rope scaling {scaling!r} is not supported by the GGUF source")


def supported_tensor_types() -> set[GGMLQuantizationType]:
    # gguf.quants keeps its dequantizers in a private table; F32 and F16 it handles inline.
    return {GGMLQuantizationType.F32, GGMLQuantizationType.F16, *gguf.quants._type_traits}


def check_tensor_types(reader: GGUFReader, path: Path) -> None:
    """Fail before any dequantization work if one tensor's type cannot be read."""
    supported = supported_tensor_types()
    for tensor in reader.tensors:
        if tensor.tensor_type not in supported:
            names = ", ".join(sorted(t.name for t in supported))
            raise SourceError(f"{path}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, "
                              f"which cannot be dequantized; supported: {names}")


# The quantization_config of a converted file whose layers keep Q8_0 weights (see the module docstring).
Q8_0_CONFIG = {
    "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"], "kv_cache_scheme": None,
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "group",
                                              "group_size": 32, "dynamic": False}}},
}


def hf_tensors(reader: GGUFReader, arch: GGUFArchitecture, config: Mapping[str, Any],
               path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """``(hf_name, array)`` for every tensor of the file, in file order: float32, or for a layer's Q8_0
    weight its int8 values and then its scales (``hf_name`` with ``_scale``)."""
    for tensor in reader.tensors:
        hf_name, layer_part = _hf_name(arch, tensor.name, path)
        # ggml lists dimensions fastest-first; numpy and HF want the reverse (out_features, in_features)
        shape = tuple(int(d) for d in reversed(tensor.shape))
        if tensor.tensor_type == GGMLQuantizationType.Q8_0 and layer_part is not None and len(shape) == 2:
            arrays = {hf_name: _q8_0_values(tensor.data, shape), hf_name + "_scale": _q8_0_scales(tensor.data, shape)}
        else:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
            arrays = {hf_name: array.reshape(shape)}
        for name, array in arrays.items():
            if layer_part in arch.rope_permuted:
                heads = int(config[arch.rope_permuted[layer_part]])
                if shape[0] % (2 * heads):
                    raise SourceError(f"{path}: tensor {tensor.name!r} has {shape[0]} rows, which do not split "
                                      f"into {heads} heads of even size")
                array = unpermute_rope_rows(array, heads)  # a row's scales move with the row
            yield name, np.ascontiguousarray(array)


# A Q8_0 block: its f16 scale, then its 32 int8 values.
_Q8_0_BLOCK, _Q8_0_BYTES = gguf.GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0]


def _q8_0_blocks(data: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    return np.asarray(data, dtype=np.uint8).reshape(shape[0], shape[1] // _Q8_0_BLOCK, _Q8_0_BYTES)


def _q8_0_values(data: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    return np.ascontiguousarray(_q8_0_blocks(data, shape)[..., 2:]).view(np.int8).reshape(shape)


def _q8_0_scales(data: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """[rows, blocks] f32: each block's f16 scale, exactly."""
    return np.ascontiguousarray(_q8_0_blocks(data, shape)[..., :2]).view(np.float16)[..., 0].astype(np.float32)


def _hf_name(arch: GGUFArchitecture, gguf_name: str, path: Path) -> tuple[str, str | None]:
    """The HF name, and the per-layer part of the GGUF name (None for a model-level tensor)."""
    layer_match = _LAYER_TENSOR.fullmatch(gguf_name)
    key = f"blk.{{layer}}.{layer_match[2]}" if layer_match else gguf_name
    if key not in arch.tensor_names:
        raise SourceError(f"{path}: tensor {gguf_name!r} has no HF equivalent for {arch.hf_architecture}")
    if layer_match:
        return arch.tensor_names[key].format(layer=layer_match[1]), layer_match[2]
    return arch.tensor_names[key], None


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order. Its rope rotates adjacent pairs, so per head its converter
    stores HF rows (0, d/2), (1, d/2+1), ... as neighbours; HF rotates row i with row i + d/2.

    Within a head, GGUF row ``2*i + j`` is HF row ``j*d/2 + i``.
    """
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
