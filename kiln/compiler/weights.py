"""The weight store: makes each final-graph parameter's tensor from the checkpoint, the model's
computed tensors and the passes' recipes, checking shapes and casting to the parameter's dtype."""

from __future__ import annotations

from typing import Iterator

import torch

from kiln.ir import Graph
from kiln.tensors import torch_dtype

from .passes.base import WeightRecipe
from .sources.hf import CheckpointTensors, SourceError


class WeightStore:
    def __init__(self, checkpoint: CheckpointTensors, computed: dict[str, torch.Tensor],
                 recipes: dict[str, WeightRecipe], source_name: str) -> None:
        self._checkpoint = checkpoint
        self._computed = computed
        self._recipes = recipes
        self._source_name = source_name

    def check_available(self, graph: Graph) -> None:
        """Fails early, naming every parameter the checkpoint lacks, before any tensor is read."""
        missing = [name for name in self._leaf_names(graph) if name not in self._computed and name not in self._checkpoint]
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise SourceError(f"{self._source_name}: checkpoint lacks tensor(s) the model needs: {shown}")

    def materialize(self, graph: Graph) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields (name, tensor) for each parameter of ``graph``, one at a time."""
        for name, param in graph.params.items():
            tensor = self._tensor(name)
            expected = param.type.concrete_shape({})
            if tuple(tensor.shape) != expected:
                where = self._checkpoint.file_of(name) if name in self._checkpoint else self._source_name
                raise SourceError(f"{where}: tensor {name!r} has shape {list(tensor.shape)}, "
                                  f"the model needs {list(expected)}")
            yield name, tensor.to(torch_dtype(param.type.dtype)).contiguous()

    def _tensor(self, name: str) -> torch.Tensor:
        recipe = self._recipes.get(name)
        if recipe is not None:
            parts = [self._tensor(source) for source in recipe.sources]
            if recipe.kind == "concat":
                return torch.cat(parts, dim=recipe.arg("dim"))
            raise ValueError(f"unknown weight recipe {recipe.kind!r}")
        if name in self._computed:
            return self._computed[name]
        return self._checkpoint.get(name)

    def _leaf_names(self, graph: Graph) -> list[str]:
        leaves: list[str] = []
        pending = list(graph.params)
        while pending:
            name = pending.pop()
            if name in self._recipes:
                pending.extend(self._recipes[name].sources)
            else:
                leaves.append(name)
        return leaves
