"""The planner: how to lay a model out over GPUs, decided from its config alone (no weights read).

``make_plan(shape, PlanRequest)`` chooses tensor parallelism (and pipeline parallelism when no
tensor split fits or the heads do not divide; expert parallelism for MoE configs) and explains the
choice with the numbers behind it: weight bytes per rank, KV bytes per token per rank, the KV room
left, the decode step memory bandwidth allows and the all-reduce traffic of a step. ``kiln plan``
prints a plan; ``--tp auto`` on compile, serve and ``Engine`` asks the same function (``auto.py``).

    shape.py     ModelShape: the dimensions a plan needs, from an HF config (dense or MoE)
    sources.py   the config of a model name (HF dir, GGUF, alias, artifact) without its weights
    hardware.py  GPU specs (memory, bandwidth, NVLink) and the stated efficiencies
    memory.py    bytes per rank for a (tp, pp, ep) layout: weights by format, KV per token
    plan.py      PlanRequest -> Plan (or PlanError with the reasons), the choosing rule
    report.py    the plan as text and as JSON
    auto.py      ``--tp auto`` / ``--pp auto``: the plan's layout for a compile, and why
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .plan import Plan, PlanError, PlanRequest, make_plan
    from .shape import ModelShape
    from .sources import model_config

__all__ = ["ModelShape", "Plan", "PlanError", "PlanRequest", "make_plan", "model_config"]

# Imported on first use: the CLI reads hardware.py's GPU names for every command, and plan.py and
# sources.py import torch and the GGUF reader (seconds that `kiln serve` should not spend).
_MODULE_OF = {"Plan": "plan", "PlanError": "plan", "PlanRequest": "plan", "make_plan": "plan",
              "ModelShape": "shape", "model_config": "sources"}


def __getattr__(name: str) -> Any:
    if name in _MODULE_OF:
        return getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
