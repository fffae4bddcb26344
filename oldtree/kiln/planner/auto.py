"""``--tp auto`` (and ``--pp auto``): the layout the planner chooses, for compiling a model.

``kiln compile``, ``kiln serve`` (and generate/chat) and ``Engine`` take ``tp="auto"``: the planner
(``make_plan``) is asked for the model's layout on this machine's GPUs (``torch.cuda.device_count()``,
or the ``gpus`` hint, which is how a CPU compiles for GPUs it does not have; one GPU when there is
neither) of the first GPU's memory (or the ``gpu_memory_gb`` hint; the planner's GPU spec without
either), for the compile's dtype, quantization and context. Its tp is taken, and its pp too unless
a number of stages is given; ``pp="auto"`` alone means the same as beside ``tp="auto"``. The
choice and the planner's reason are returned and logged (``kiln.planner.auto`` at INFO, the
rejected layouts at DEBUG; the command line prints the reason). A layout that cannot fit raises the planner's ``PlanError``, which names why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from .plan import GB, Plan, PlanRequest, make_plan
from .shape import ModelShape
from .sources import model_config

AUTO = "auto"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayoutHints:
    """What the planner is told besides the model: the GPUs to plan for (None: this machine's)."""

    gpus: int | None = None
    gpu_memory_gb: float | None = None
    dtype: str = "bf16"
    quantization: str | None = None
    max_seq_len: int | None = None


def parse_count(text: str, what: str) -> int | str:
    """A ``--tp`` / ``--pp`` value: a positive number, or ``auto``."""
    if text == AUTO:
        return AUTO
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{what} must be a number of ranks or 'auto', got {text!r}") from None
    if value < 1:
        raise ValueError(f"{what} must be at least 1, got {value}")
    return value


@dataclass(frozen=True)
class ChosenLayout:
    tp: int
    pp: int
    reason: str | None  # the planner's, when it chose (None: the numbers were given)


def resolve_layout(model: str | Path, tp: int | str, pp: int | str | None, hints: LayoutHints) -> ChosenLayout:
    """The tp and pp to compile ``model`` with: the numbers given, or the planner's where ``auto``; a
    ``pp`` of None is 1, or the planner's beside ``tp="auto"``."""
    if tp != AUTO and pp != AUTO:
        return ChosenLayout(tp, pp or 1, None)
    if tp != AUTO:
        raise ValueError(f"pp='auto' is chosen with tp by the planner: give tp='auto' too, or a number of stages "
                         f"beside tp={tp}")
    plan = plan_for(model, hints)
    chosen_pp = plan.pp if pp in (AUTO, None) else pp
    reason = (f"tp=auto: tp={plan.tp}, pp={chosen_pp} for {plan.gpus} GPU(s) of {plan.gpu_memory_bytes / GB:g} GB: "
              f"{plan.chosen_because}")
    log.info("%s", reason)
    for line in plan.rejected:
        log.debug("tp=auto: not %s", line)
    return ChosenLayout(plan.tp, chosen_pp, reason)


def plan_for(model: str | Path, hints: LayoutHints) -> Plan:
    import torch

    gpus = hints.gpus or torch.cuda.device_count() or 1
    memory_gb = hints.gpu_memory_gb
    if memory_gb is None and torch.cuda.is_available():
        memory_gb = torch.cuda.get_device_properties(0).total_memory / GB
    shape = ModelShape.from_hf(model_config(model).config)
    return make_plan(shape, PlanRequest(gpus=gpus, gpu_memory_gb=memory_gb, dtype=hints.dtype,
                                        quantization=hints.quantization, max_seq_len=hints.max_seq_len))
