"""What every model file gives the compiler: ``build(hf_config, BuildOptions) -> BuiltModel``.

Contract: graph parameters carry the names the HF checkpoint uses, so the compiler loads each one
by its own name; parameters the model computes (rope tables) come in ``BuiltModel.computed``, and
those it assembles from checkpoint tensors (stacked experts) as ``BuiltModel.recipes``.
The graph's inputs are the step schema's fields (``kiln.step_schema``) and the KV caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.compiler.recipes import Recipe
from kiln.ir import DType, Graph
from kiln.step_schema import LOGIT_ROW, STEP_SCHEMA, StepSchema


@dataclass(frozen=True)
class BuildOptions:
    dtype: DType
    page_size: int
    max_seq_len: int | None = None
    step_schema: StepSchema = STEP_SCHEMA  # the graph's step inputs, one per field


@dataclass(frozen=True)
class BuiltModel:
    """The graph, the parameters the model computes itself, and the facts the runtime sizes its KV
    pool and requests by."""

    graph: Graph
    computed: dict[str, torch.Tensor]
    max_seq_len: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    # How parameters the graph names but the checkpoint lacks are made (MoE experts stacked from
    # per-expert tensors); the passes' recipes build on them.
    recipes: tuple[Recipe, ...] = ()


def step_outputs(options: BuildOptions, values: dict[str, str]) -> list[str]:
    """The graph outputs the step schema asks for per logits row, in its order, from the values a
    model can give (by output name); an output the model cannot give is an error naming those it
    can. Per-token outputs are a pass's to add (``compiler/passes/expose_hidden_states.py``)."""
    wanted = [o for o in options.step_schema.outputs if o.axis == LOGIT_ROW]
    missing = [o.name for o in wanted if o.name not in values]
    if missing:
        raise ValueError(f"this model cannot return {', '.join(missing)} from a step; it can return "
                         f"{', '.join(sorted(values))}")
    return [values[o.name] for o in wanted]
