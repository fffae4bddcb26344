"""Weight recipes: how each artifact weight is made from source tensors, as data.

Passes never touch tensors. A pass that changes what a parameter holds records a recipe for it in
``PassContext.recipes``: fusing q/k/v a ``Concat`` of the three weights, a tensor-parallel shard a
``Shard`` (each rank's ``Slice``; a row-parallel bias a ``FirstRank``), quantization a ``Quantize``
(which also makes the scales its format names). A model may start the list (``BuiltModel.recipes``):
an MoE layer's experts ``Stack``ed into one weight. A recipe's inputs are checkpoint or computed
tensors, or other recipes' outputs.
Every rank's weights come from the same recipes: ``for_rank`` turns each ``Shard`` into that
rank's ``Slice`` before they are applied. The artifact writer asks
``apply_recipes`` for the final graph's parameters; it reads each source when first needed and
yields the weights one at a time, so a compile holds a few tensors at once, not the model twice.
A pre-quantized checkpoint's weights pass through them as ``QuantizedTensor`` values, never dequantized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import torch

from kiln.ir.weights import WeightFormat

from kiln.kernels.quantize import quantize

from .quantized_tensor import QuantizedTensor, concat


@dataclass(frozen=True)
class Concat:
    """``output``: the ``inputs`` joined along ``axis``."""

    output: str
    inputs: tuple[str, ...]
    axis: int = 0

    @property
    def outputs(self) -> tuple[str, ...]:
        return (self.output,)

    def make(self, tensors: list[torch.Tensor | QuantizedTensor]) -> tuple[torch.Tensor | QuantizedTensor, ...]:
        return (concat(tensors, self.axis),)


@dataclass(frozen=True)
class Stack:
    """``output``: the ``inputs`` (of one shape) stacked along a new first axis (an MoE layer's experts)."""

    output: str
    inputs: tuple[str, ...]

    @property
    def outputs(self) -> tuple[str, ...]:
        return (self.output,)

    def make(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) != 1:
            raise ValueError(f"{self.output}: cannot stack tensors of shapes {sorted(shapes)}")
        return (torch.stack(tensors),)


@dataclass(frozen=True)
class Slice:
    """``output``: part ``index`` of ``count`` equal parts of ``source`` along ``axis`` (one rank's shard).
    With ``groups`` > 1 the axis holds that many equal blocks (a stacked expert's gate rows, then its
    up rows), and the part is taken from each block, the parts joined in block order."""

    output: str
    source: str
    axis: int
    index: int
    count: int
    groups: int = 1

    @property
    def inputs(self) -> tuple[str, ...]:
        return (self.source,)

    @property
    def outputs(self) -> tuple[str, ...]:
        return (self.output,)

    def make(self, tensors: list[torch.Tensor | QuantizedTensor]) -> tuple[torch.Tensor | QuantizedTensor, ...]:
        (tensor,) = tensors
        size = tensor.shape[self.axis]
        if size % (self.count * self.groups):
            shards = f"{self.count}" if self.groups == 1 else f"{self.groups} blocks x {self.count}"
            raise ValueError(f"{self.output}: axis {self.axis} of {self.source} ({size}) does not split into "
                             f"{shards} equal shards")
        block, part = size // self.groups, size // self.groups // self.count
        parts = [tensor.narrow(self.axis, g * block + self.index * part, part) for g in range(self.groups)]
        return (parts[0] if self.groups == 1 else concat(parts, self.axis),)


@dataclass(frozen=True)
class Shard:
    """``output``: one rank's part of ``source`` along ``axis``, cut into ``parts`` equal parts over
    ``ranks`` ranks. Rank r holds part ``r * parts // ranks``: with as many parts as ranks each holds
    its own; with fewer, each part is held by ``ranks // parts`` neighbouring ranks (KV heads
    replicated when there are more ranks than heads). ``cyclic``: rank r holds part ``r % parts``
    instead (each expert group's ranks splitting its experts' width: ``shard_ep``); ``groups``: as
    ``Slice``'s."""

    output: str
    source: str
    axis: int
    parts: int
    ranks: int
    cyclic: bool = False
    groups: int = 1

    def __post_init__(self) -> None:
        if self.parts < 1 or self.ranks % self.parts:
            raise ValueError(f"{self.output}: {self.parts} parts cannot be spread evenly over {self.ranks} ranks")

    @property
    def inputs(self) -> tuple[str, ...]:
        return (self.source,)

    @property
    def outputs(self) -> tuple[str, ...]:
        return (self.output,)

    def for_rank(self, rank: int) -> Slice:
        part = rank % self.parts if self.cyclic else rank * self.parts // self.ranks
        return Slice(self.output, self.source, self.axis, part, self.parts, self.groups)


@dataclass(frozen=True)
class FirstRank:
    """``output``: ``source`` on rank 0, zeros of its shape on the other ranks (a bias added to a sum
    over the ranks, which must count it once)."""

    output: str
    source: str

    @property
    def inputs(self) -> tuple[str, ...]:
        return (self.source,)

    @property
    def outputs(self) -> tuple[str, ...]:
        return (self.output,)

    def for_rank(self, rank: int) -> Slice | Zeros:
        return Slice(self.output, self.source, 0, 0, 1) if rank == 0 else Zeros(self.output, self.source)


@dataclass(frozen=True)
class Zeros:
    """``output``: zeros of ``source``'s shape and dtype."""

    output: str
    source: str

    @property
    def inputs(self) -> tuple[str, ...]:
        return (self.source,)

    @property
    def outputs(self) -> tuple[str, ...]:
        return (self.output,)

    def make(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return (torch.zeros_like(tensors[0]),)


@dataclass(frozen=True)
class Constant:
    """``output``: the int32 array ``values`` (nested tuples for more axes): a value the passes compute,
    such as where each rank's shard of the vocabulary starts, or each expert's physical copies."""

    output: str
    values: tuple

    @property
    def inputs(self) -> tuple[str, ...]:
        return ()

    @property
    def outputs(self) -> tuple[str, ...]:
        return (self.output,)

    def make(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return (torch.tensor(self.values, dtype=torch.int32),)


@dataclass(frozen=True)
class Quantize:
    """``output`` and the scales its ``format`` names: ``source`` quantized to ``format``."""

    output: str
    source: str
    format: WeightFormat

    def __post_init__(self) -> None:
        if not self.format.quantized:
            raise ValueError(f"{self.output}: Quantize needs a quantized format, got {self.format}")

    @property
    def inputs(self) -> tuple[str, ...]:
        return (self.source,)

    @property
    def outputs(self) -> tuple[str, ...]:
        return (self.output, *self.format.scales)

    def make(self, tensors: list[torch.Tensor | QuantizedTensor]) -> tuple[torch.Tensor, ...]:
        (tensor,) = tensors
        if isinstance(tensor, QuantizedTensor):  # pre-quantized: kept exactly as the checkpoint has it
            if tensor.scheme != self.format.scheme:
                raise ValueError(f"{self.output}: {self.source} comes as {tensor.scheme}, not {self.format.scheme}; "
                                 "kiln does not requantize a pre-quantized weight")
            return (tensor.stored, *tensor.scales)
        values, scales = quantize(tensor, self.format.scheme)
        return (values, *scales)


Recipe = Concat | Stack | Slice | Shard | FirstRank | Zeros | Constant | Quantize


def for_rank(recipes: Sequence[Recipe], rank: int) -> list[Recipe]:
    """The recipes that make rank ``rank``'s weights: each ``Shard`` or ``FirstRank`` as what it is on that rank."""
    return [recipe.for_rank(rank) if isinstance(recipe, (Shard, FirstRank)) else recipe for recipe in recipes]


def apply_recipes(recipes: Sequence[Recipe], names: Iterable[str],
                  read: Callable[[str], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) for each of ``names``: made by the recipe that outputs it, from its inputs
    (recursively), or, when no recipe does, ``read(name)``. A recipe with several outputs runs once;
    its other outputs wait until asked for."""
    by_output = recipes_by_output(recipes)
    waiting: dict[str, torch.Tensor] = {}

    def tensor(name: str) -> torch.Tensor:
        if name in waiting:
            return waiting.pop(name)
        recipe = by_output.get(name)
        if recipe is None:
            return read(name)
        made = recipe.make([tensor(source) for source in recipe.inputs])
        waiting.update(zip(recipe.outputs, made, strict=True))
        return waiting.pop(name)

    for name in names:
        yield name, tensor(name)


def source_names(recipes: Sequence[Recipe], names: Iterable[str]) -> list[str]:
    """The tensors ``apply_recipes`` would read to make ``names``, in order: what the checkpoint must hold."""
    by_output = recipes_by_output(recipes)
    sources: dict[str, None] = {}

    def visit(name: str) -> None:
        recipe = by_output.get(name)
        if recipe is None:
            sources[name] = None
        else:
            for source in recipe.inputs:
                visit(source)

    for name in names:
        visit(name)
    return list(sources)


def recipes_by_output(recipes: Sequence[Recipe]) -> dict[str, Recipe]:
    """Each weight a recipe makes mapped to that recipe; a weight made twice is an error."""
    by_output: dict[str, Recipe] = {}
    for recipe in recipes:
        for name in recipe.outputs:
            if name in by_output:
                raise ValueError(f"weight {name} is made by two recipes: {by_output[name]} and {recipe}")
            by_output[name] = recipe
    return by_output
