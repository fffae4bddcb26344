"""Reading a PEFT LoRA adapter directory and checking it against an artifact's LoRA layout.

A PEFT directory holds ``adapter_config.json`` (rank ``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``, ...) and ``adapter_model.safetensors`` with, for each adapted module,
``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``....lora_B.weight`` ``[out, r]``. The
update a module adds is ``scaling * B @ A @ x`` with ``scaling = lora_alpha / r`` (rsLoRA:
``lora_alpha / sqrt(r)``); the scaling is folded into B here, so the kernels multiply only.

What kiln serves: plain LoRA on the layout's projections, any rank up to its ``max_rank``. Refused,
each with a message naming what is wrong (``AdapterError``): DoRA, biases, embedding or lm_head
targets (and ``modules_to_save``), per-module rank/alpha patterns, a rank above the maximum, a module
the artifact has no hook on, a weight whose shape differs from the base model's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from kiln.lora_layout import LoraLayout

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_EMBEDDING_MODULES = ("embed_tokens", "lm_head")


class AdapterError(ValueError):
    """An adapter kiln cannot serve on this artifact; the message says why and what is supported."""


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter in host memory: per module, ``(A [r, in], B [out, r] times the scaling)``."""

    path: str
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def load_adapter(path: str | Path, layout: LoraLayout, dtype: torch.dtype) -> LoraAdapter:
    directory = Path(path).expanduser()
    config_file, weights_file = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_file.is_file() or not weights_file.is_file():
        raise AdapterError(f"{directory}: not a PEFT LoRA adapter directory (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    config = json.loads(config_file.read_text())
    rank, scaling = _check_config(directory, config, layout)
    tensors = load_file(str(weights_file))
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, part = _split_key(directory, key)
        modules.setdefault(module, {})[part] = tensor
    weights = {}
    for module, parts in sorted(modules.items()):
        if set(parts) != {"lora_A", "lora_B"}:
            raise AdapterError(f"{directory}: {module} has {', '.join(sorted(parts))}; a LoRA module needs lora_A and lora_B")
        a, b = parts["lora_A"], parts["lora_B"]
        found = layout.slice_of(module)
        if found is None:
            raise AdapterError(f"{directory}: adapts {module}, which has no LoRA hook in this artifact (compiled "
                               f"for {', '.join(layout.target_modules)})")
        hook, index = found
        piece = hook.slices[index]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{directory}: {module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} are not a "
                               f"rank-r pair ([r, in] and [out, r])")
        if a.shape[0] != rank:
            raise AdapterError(f"{directory}: {module} has rank {a.shape[0]}, the config's r is {rank}")
        if a.shape[1] != piece.in_features or b.shape[0] != piece.out_features:
            raise AdapterError(f"{directory}: shape mismatch at {module}: the adapter maps {a.shape[1]} -> "
                               f"{b.shape[0]} features, the base model's {module} maps {piece.in_features} -> "
                               f"{piece.out_features}")
        weights[module] = (a.to(dtype), (b.float() * scaling).to(dtype))
    if not weights:
        raise AdapterError(f"{directory}: {WEIGHTS_FILE} holds no LoRA weights")
    return LoraAdapter(str(directory), rank, weights)


def _check_config(directory: Path, config: dict, layout: LoraLayout) -> tuple[int, float]:
    """The adapter's rank and scaling, after refusing what kiln does not serve."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"{directory}: peft_type {peft_type!r} is not supported; supported: LORA")
    if config.get("use_dora"):
        raise AdapterError(f"{directory}: DoRA adapters (use_dora) are not supported; supported: plain LoRA")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise AdapterError(f"{directory}: LoRA biases (bias={config.get('bias')!r}) are not supported; supported: bias='none'")
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    embedding = sorted({t for t in targets + list(config.get("modules_to_save") or [])
                        if any(e in t for e in _EMBEDDING_MODULES)})
    if embedding:
        raise AdapterError(f"{directory}: adapts {', '.join(embedding)}: embedding and lm_head targets are not "
                           f"supported; supported: {', '.join(layout.target_modules)}")
    if config.get("modules_to_save"):
        raise AdapterError(f"{directory}: modules_to_save ({', '.join(config['modules_to_save'])}) replaces base "
                           f"weights, which is not supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise AdapterError(f"{directory}: per-module rank_pattern/alpha_pattern are not supported; supported: "
                           f"one r and lora_alpha for every module")
    rank = int(config["r"])
    if not 1 <= rank <= layout.max_rank:
        raise AdapterError(f"{directory}: rank {rank} is above the maximum LoRA rank {layout.max_rank} "
                           f"(--max-lora-rank / max_lora_rank)")
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, scaling


def _split_key(directory: Path, key: str) -> tuple[str, str]:
    """``base_model.model.M.lora_A.weight`` -> (``M``, ``lora_A``)."""
    parts = key.split(".")
    if not key.startswith(_PREFIX) or len(parts) < 5 or parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B"):
        raise AdapterError(f"{directory}: tensor {key!r} is not a LoRA weight "
                           f"({_PREFIX}<module>.lora_A.weight / .lora_B.weight)")
    module = ".".join(parts[2:-2])
    if any(module.endswith(e) for e in _EMBEDDING_MODULES):
        raise AdapterError(f"{directory}: adapts {module}: embedding and lm_head targets are not supported")
    return module, parts[-2]
