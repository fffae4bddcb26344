"""The architecture registry: HF ``architectures`` names -> the model file that builds them."""

from __future__ import annotations

from types import ModuleType
from typing import Any, Mapping

from . import eagle, llama, moe

_FAMILIES: tuple[ModuleType, ...] = (llama, moe, eagle)


def supported_architectures() -> list[str]:
    return sorted(arch for family in _FAMILIES for arch in family.ARCHITECTURES)


def family_for(config: Mapping[str, Any]) -> ModuleType:
    """The model module for an HF config; an unsupported architecture names itself and the supported ones."""
    names = config.get("architectures") or []
    if not names:
        raise ValueError(f"config.json names no architectures; supported: {', '.join(supported_architectures())}")
    for family in _FAMILIES:
        if names[0] in family.ARCHITECTURES:
            return family
    raise ValueError(f"unsupported architecture {names[0]!r}; supported: {', '.join(supported_architectures())}")
