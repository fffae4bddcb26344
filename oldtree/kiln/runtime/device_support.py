"""Whether a device can run an artifact's quantization, checked where an artifact is loaded onto one.

FP8 (e4m3) GEMMs, per-token FP8 activations and an FP8 KV pool need a CUDA GPU of compute capability
8.9 or newer (Ada, Hopper, Blackwell): older GPUs have no FP8 conversions in hardware, so Triton
cannot build the kernels and ``torch._scaled_mm`` refuses. The CPU runs every scheme through the torch
references. On an older GPU an artifact that needs FP8 is refused, naming what needs it, unless the
reference fallback is asked for (``EngineOptions.reference_fallback``, ``kiln serve
--reference-fallback``): then every kernel runs its torch reference, which computes FP8 in f32 on
any GPU, correctly and slowly, and CUDA graphs are off where a reference reads device values.
"""

from __future__ import annotations

import torch

from .artifact import Artifact

FP8_CAPABILITY = (8, 9)


def fp8_needs(artifact: Artifact) -> list[str]:
    """What in the artifact computes in FP8: its weight scheme, its activations, its KV pool."""
    needs = []
    quantization = artifact.manifest.get("quantization") or {}
    if str(quantization.get("scheme", "")).startswith("fp8"):
        needs.append(f"{quantization['scheme']} weights")
    if quantization.get("act_quant") == "fp8_per_token":
        needs.append("fp8_per_token activations")
    if artifact.runtime.get("kv_cache_dtype") == "f8e4m3":
        needs.append("an fp8_e4m3 KV cache")
    return needs


def uses_references(artifact: Artifact, device: torch.device, reference_fallback: bool = False) -> bool:
    """Whether ``artifact`` must run its torch references on ``device``: True only when the device
    cannot run its FP8 and the fallback was asked for; ValueError (``fp8_refusal``'s message) when it
    was not."""
    needs = fp8_needs(artifact)
    if device.type != "cuda" or not needs:
        return False
    refusal = fp8_refusal(needs, torch.cuda.get_device_capability(device), f"{device} ({torch.cuda.get_device_name(device)})")
    if refusal is None:
        return False
    if reference_fallback:
        return True
    raise ValueError(f"{artifact.path}: {refusal}")


def fp8_refusal(needs: list[str], capability: tuple[int, int], gpu: str) -> str | None:
    """Why a GPU of ``capability`` cannot run what ``needs`` FP8, and what to do instead; None when it can."""
    if not needs or capability >= FP8_CAPABILITY:
        return None
    return (f"{', '.join(needs)} need FP8, which needs a CUDA GPU of compute capability {FP8_CAPABILITY[0]}."
            f"{FP8_CAPABILITY[1]} or newer (Ada, Hopper); {gpu} is {capability[0]}.{capability[1]}. Compile "
            "without FP8 (--quantization w8a8_int8 or w8a16_int8, --kv-cache-dtype auto), or run the torch "
            "reference kernels, slowly: EngineOptions(reference_fallback=True), Engine(reference_fallback=True), "
            "kiln serve/generate --reference-fallback")
