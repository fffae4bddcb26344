"""Pre-quantized HF checkpoints: ``config.json``'s ``quantization_config`` read into kiln's weight formats.

Supported, each mapped onto a kiln quantization method (``kiln.compiler.quantization``) without
requantizing a weight:

    quant_method "fp8", no weight_block_size   FP8 e4m3 weight, one scale (``weight_scale`` or
                                               ``weight_scale_inv``) per tensor -> fp8_channel
    quant_method "fp8", weight_block_size      FP8 e4m3 weight, ``weight_scale_inv`` per 128x128 block
      [128, 128] (DeepSeek-V3, Qwen3 FP8)      -> fp8_block128 (the block's scale on each of its rows)
    quant_method "compressed-tensors"          (llm-compressor) weights float8 or int8, ``weight_scale``
                                               per channel or per tensor -> fp8_channel / int8_channel;
                                               int8 weight-only also per group of 32 -> int8_block32

A per-tensor scale becomes the same scale on each row and a block's scale is repeated on each of its
rows: exact, and it keeps fused and sharded weights exact too (``compiler/quantized_tensor.py``).
Activations: FP8 and W8A8 checkpoints must quantize them dynamically per token (the fp8 method's
``fp8_per_token``, compressed-tensors' ``strategy: token``); static activation scales, other
quant_methods (awq, gptq, bitsandbytes, ...), and other bit widths or strategies are refused by name.
A weight the checkpoint leaves plain (its ``ignore`` list) is quantized by kiln like any other GEMM
weight of the model, so one kernel family runs it; the lm_head and the embedding stay plain, as
without a pre-quantized checkpoint (``passes/quantize.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kiln.ir.weights import SCHEMES, QuantScheme
from kiln.tensors import torch_dtype

from ..quantization import METHODS, QuantizationMethod
from ..quantized_tensor import QuantizedTensor
from .hf import CheckpointTensors, SourceError

SUPPORTED = ('quant_method "fp8" (dynamic activations; per-tensor scales or weight_block_size [128, 128]), '
             '"compressed-tensors" (8-bit float or int weights per channel or per tensor with dynamic per-token '
             'activations, or int8 weight-only per channel, per tensor or per group of 32)')
BLOCK = 128


@dataclass(frozen=True)
class CheckpointQuantization:
    """How a checkpoint's GEMM weights are stored: ``X.weight`` beside its scale ``X.weight`` +
    ``scale_suffix``, per ``strategy`` (tensor, channel, block, or group); read as ``method``'s scheme."""

    description: str  # for messages and the manifest, e.g. "fp8 (128x128 block scales)"
    method: QuantizationMethod
    strategy: str  # "tensor", "channel", "block" (128x128) or "group" (of the scheme's block)
    scale_suffixes: tuple[str, ...]  # the first present is the scale; all are hidden from the model's names

    def to_json(self) -> dict[str, Any]:
        return {"description": self.description, "method": self.method.name,
                "scheme": self.method.scheme.name, "act_quant": self.method.act_quant}


def read_quantization(config: dict[str, Any], path: Path) -> CheckpointQuantization | None:
    """The checkpoint's quantization from its config (None: a plain checkpoint); SourceError when kiln
    cannot load it as it is."""
    quant = config.get("quantization_config")
    if quant is None:
        return None
    where = f"{path / 'config.json'}: quantization_config"
    if not isinstance(quant, dict):
        raise SourceError(f"{where} is not an object")
    method = quant.get("quant_method")
    if method == "fp8":
        return _fp8(quant, where)
    if method == "compressed-tensors":
        return _compressed_tensors(quant, where)
    raise SourceError(f"{where}: quant_method {method!r} is not supported; supported: {SUPPORTED}")


def _fp8(quant: dict[str, Any], where: str) -> CheckpointQuantization:
    if quant.get("fmt", "e4m3") != "e4m3":
        raise SourceError(f"{where}: fp8 format {quant['fmt']!r} is not supported; supported: e4m3")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise SourceError(f"{where}: activation_scheme {quant['activation_scheme']!r} (static input scales) is "
                          "not supported; supported: dynamic (activations quantized per token at run time)")
    block = quant.get("weight_block_size")
    if block is None:
        return CheckpointQuantization("fp8 (per-tensor scales)", METHODS["fp8"], "tensor",
                                      ("_scale", "_scale_inv"))
    if list(block) != [BLOCK, BLOCK]:
        raise SourceError(f"{where}: weight_block_size {block} is not supported; supported: [128, 128] or none")
    method = QuantizationMethod("fp8", SCHEMES["fp8_block128"], "fp8_per_token")
    return CheckpointQuantization("fp8 (128x128 block scales)", method, "block", ("_scale_inv", "_scale"))


def _compressed_tensors(quant: dict[str, Any], where: str) -> CheckpointQuantization:
    if quant.get("format") not in ("float-quantized", "int-quantized", "naive-quantized"):
        raise SourceError(f"{where}: compressed-tensors format {quant.get('format')!r} is not supported; "
                          "supported: float-quantized, int-quantized, naive-quantized")
    if quant.get("kv_cache_scheme") is not None:
        raise SourceError(f"{where}: kv_cache_scheme is not supported (kiln's FP8 KV cache is a runtime "
                          "option, --kv-cache-dtype); supported: null")
    groups = list((quant.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise SourceError(f"{where}: {len(groups)} config_groups; supported: exactly one")
    (group,) = groups
    weights, activations = group.get("weights") or {}, group.get("input_activations")
    kind, strategy = weights.get("type"), weights.get("strategy")
    if weights.get("num_bits") != 8 or kind not in ("float", "int") or not weights.get("symmetric", True) \
            or weights.get("dynamic"):
        raise SourceError(f"{where}: weights {_brief(weights)} are not supported; supported: 8-bit symmetric "
                          "float or int with static scales")
    if activations is None:
        if kind != "int":
            raise SourceError(f"{where}: float8 weight-only is not supported; supported: float8 W8A8 (dynamic "
                              "per-token activations) or int8 weight-only")
        if strategy == "group":
            if weights.get("group_size") != 32:
                raise SourceError(f"{where}: int8 group_size {weights.get('group_size')} is not supported; "
                                  "supported: 32")
            method = QuantizationMethod("w8a16_int8", SCHEMES["int8_block32"], None)
            return CheckpointQuantization("compressed-tensors int8 weight-only (groups of 32)", method, "group",
                                          ("_scale",))
        method = METHODS["w8a16_int8"]
    else:
        if (activations.get("num_bits") != 8 or activations.get("type") != kind or not activations.get("dynamic")
                or activations.get("strategy") != "token" or not activations.get("symmetric", True)):
            raise SourceError(f"{where}: input_activations {_brief(activations)} are not supported; supported: "
                              f"8-bit {kind}, symmetric, dynamic, strategy token")
        method = METHODS["fp8" if kind == "float" else "w8a8_int8"]
    if strategy not in ("channel", "tensor"):
        raise SourceError(f"{where}: weight strategy {strategy!r} is not supported; supported: channel, tensor"
                          + (", group (int8 weight-only, size 32)" if kind == "int" else ""))
    what = f"{'float8' if kind == 'float' else 'int8'} {'W8A8' if activations else 'weight-only'}"
    return CheckpointQuantization(f"compressed-tensors {what} (per-{strategy} scales)", method, strategy,
                                  ("_scale",))


def _brief(spec: dict[str, Any]) -> str:
    keys = ("num_bits", "type", "strategy", "group_size", "symmetric", "dynamic")
    return "{" + ", ".join(f"{k}={spec.get(k)!r}" for k in keys if k in spec) + "}"


class PrequantizedTensors(CheckpointTensors):
    """The checkpoint's tensors with each quantized weight read as a ``QuantizedTensor`` in kiln's format;
    scale and zero-point tensors are not names of their own."""

    def __init__(self, files_by_name: dict[str, Path], quantization: CheckpointQuantization) -> None:
        self._quantization = quantization
        self._all = CheckpointTensors(files_by_name)
        self._scale_of = {name: next(name + s for s in quantization.scale_suffixes if name + s in files_by_name)
                          for name in files_by_name
                          if any(name + s in files_by_name for s in quantization.scale_suffixes)}
        hidden = set(self._scale_of.values())
        hidden |= {name for name in files_by_name if name.endswith(("_zero_point", ".input_scale"))}
        super().__init__({name: file for name, file in files_by_name.items() if name not in hidden})

    def get(self, name: str) -> torch.Tensor | QuantizedTensor:
        tensor = self._all.get(name)
        scale_name = self._scale_of.get(name)
        if scale_name is None:
            return tensor
        return _read(name, tensor, self._all.get(scale_name), self._quantization, self.file_of(name))


def _read(name: str, stored: torch.Tensor, scale: torch.Tensor, quantization: CheckpointQuantization,
          file: Path) -> QuantizedTensor:
    """``stored`` and its checkpoint ``scale`` as kiln's scheme holds them: one f32 scale per row, or per
    row and block of columns."""
    scheme: QuantScheme = quantization.method.scheme
    if stored.dtype != torch_dtype(scheme.storage) or stored.dim() != 2:
        raise SourceError(f"{file}: {name} is {stored.dtype} {list(stored.shape)}; {quantization.description} "
                          f"stores 2-D {torch_dtype(scheme.storage)} weights")
    rows, columns = stored.shape
    scale = scale.float()
    strategy = quantization.strategy
    if strategy == "tensor" and scale.numel() == 1:
        per_row = scale.reshape(()).expand(rows).contiguous()
    elif strategy == "channel" and scale.numel() == rows:
        per_row = scale.reshape(rows)
    elif strategy == "block" and columns % BLOCK == 0 and tuple(scale.shape) == (-(-rows // BLOCK), columns // BLOCK):
        per_row = scale.repeat_interleave(BLOCK, dim=0)[:rows].contiguous()
    elif strategy == "group" and columns % scheme.block == 0 and tuple(scale.shape) == (rows, columns // scheme.block):
        per_row = scale
    else:
        raise SourceError(f"{file}: {name} [{rows}, {columns}] has a scale of shape {list(scale.shape)}, which "
                          f"{quantization.description} cannot read (block scales need columns in whole blocks)")
    return QuantizedTensor(stored, (per_row,), scheme)
