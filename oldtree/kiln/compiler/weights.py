"""The weight store: makes each final-graph parameter's tensor from the checkpoint and the model's
computed tensors through the passes' recipes (``recipes.apply_recipes``), one rank's at a time,
checking each against its parameter's shape and casting a plain one to its dtype (a quantized one
must come in its storage dtype: a cast would not quantize it). A pre-quantized checkpoint weight
that ends up in a plain parameter (an lm_head or embedding the checkpoint quantized, which kiln keeps
plain) is dequantized."""

from __future__ import annotations

from typing import Iterator, Sequence

import torch

from kiln.ir import Graph
from kiln.tensors import torch_dtype

from .quantized_tensor import QuantizedTensor
from .recipes import Recipe, apply_recipes, for_rank, source_names
from .sources.hf import CheckpointTensors, SourceError


class WeightStore:
    def __init__(self, checkpoint: CheckpointTensors, computed: dict[str, torch.Tensor],
                 recipes: Sequence[Recipe], source_name: str) -> None:
        self._checkpoint = checkpoint
        self._computed = computed
        self._recipes = recipes
        self._source_name = source_name

    def check_available(self, graph: Graph) -> None:
        """Fails early, naming every tensor the checkpoint lacks, before any tensor is read."""
        missing = [name for name in source_names(self._recipes, graph.params)
                   if name not in self._computed and name not in self._checkpoint]
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise SourceError(f"{self._source_name}: checkpoint lacks tensor(s) the model needs: {shown}")

    def materialize(self, graph: Graph, rank: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields (name, tensor) for each parameter of ``graph`` as rank ``rank`` holds it, one at a time."""
        for name, tensor in apply_recipes(for_rank(self._recipes, rank), graph.params, self._read):
            param = graph.params[name]
            if isinstance(tensor, QuantizedTensor):
                tensor = tensor.dequantize()
            expected = param.type.concrete_shape({})
            if tuple(tensor.shape) != expected:
                where = self._checkpoint.file_of(name) if name in self._checkpoint else self._source_name
                raise SourceError(f"{where}: tensor {name!r} has shape {list(tensor.shape)}, "
                                  f"the model needs {list(expected)}")
            dtype = torch_dtype(param.type.dtype)
            if param.format.quantized and tensor.dtype != dtype:
                raise SourceError(f"{self._source_name}: {param.format.scheme} weight {name!r} comes as "
                                  f"{tensor.dtype}, not its storage dtype {dtype}: no Quantize recipe makes it")
            yield name, tensor.to(dtype).contiguous()

    def _read(self, name: str) -> torch.Tensor:
        if name in self._computed:
            return self._computed[name]
        return self._checkpoint.get(name)
