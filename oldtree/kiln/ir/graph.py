"""The graph: an ordered SSA list of immutable nodes over named inputs and parameters.

Every value has one name, unique in the graph: a graph input (``%token_ids``), a parameter
(``@model.norm.weight``) or a node output (``%12``). Nodes are in execution order; passes return
new graphs and never mutate one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from .ops import get_op
from .types import TensorType
from .weights import PLAIN, REPLICATED, Placement, QuantizedType, WeightFormat


class FrozenAttrs(Mapping[str, Any]):
    """A read-only, hashable attribute mapping."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, Any] | None = None) -> None:
        self._items = dict(sorted((items or {}).items()))

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple(self._items.items()))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self._items) == dict(other)

    def __repr__(self) -> str:
        return f"FrozenAttrs({self._items!r})"


@dataclass(frozen=True)
class Param:
    """A weight the graph reads. ``type`` is its storage; ``format`` says how to read it (plain, or a
    quantization scheme with its scale parameters); ``placement`` how ranks hold it (replicated until
    the sharding passes say otherwise). ``kiln.ir.weights`` defines both."""

    name: str
    type: TensorType
    format: WeightFormat = PLAIN
    placement: Placement = REPLICATED

    @property
    def value_type(self) -> TensorType:
        """The type ops see: a quantized parameter's storage type carries its format."""
        if self.format.quantized:
            return QuantizedType(self.type.shape, self.type.dtype, self.format)
        return self.type


@dataclass(frozen=True)
class Node:
    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    types: tuple[TensorType, ...]
    attrs: FrozenAttrs = dataclasses.field(default_factory=FrozenAttrs)

    @property
    def type(self) -> TensorType:
        """The type of a single-output node."""
        if len(self.types) != 1:
            raise ValueError(f"{self.op} has {len(self.types)} outputs")
        return self.types[0]

    @property
    def out(self) -> str:
        """The name of a single-output node's value."""
        if len(self.outputs) != 1:
            raise ValueError(f"{self.op} has {len(self.outputs)} outputs")
        return self.outputs[0]


@dataclass(frozen=True)
class Graph:
    name: str
    inputs: Mapping[str, TensorType]
    params: Mapping[str, Param]
    nodes: tuple[Node, ...]
    outputs: tuple[str, ...]

    def replace(self, **changes: Any) -> "Graph":
        if "nodes" in changes:
            changes["nodes"] = tuple(changes["nodes"])
        if "outputs" in changes:
            changes["outputs"] = tuple(changes["outputs"])
        return dataclasses.replace(self, **changes)

    def value_types(self) -> dict[str, TensorType]:
        """Every value name in the graph mapped to its type."""
        types: dict[str, TensorType] = dict(self.inputs)
        types.update((name, p.value_type) for name, p in self.params.items())
        for node in self.nodes:
            types.update(zip(node.outputs, node.types))
        return types

    def producers(self) -> dict[str, Node]:
        """Each node output's name mapped to the node that makes it."""
        return {out: node for node in self.nodes for out in node.outputs}

    def users(self) -> dict[str, list[Node]]:
        """Each value's name mapped to the nodes that read it, in order."""
        result: dict[str, list[Node]] = {}
        for node in self.nodes:
            for name in node.inputs:
                result.setdefault(name, []).append(node)
        return result


def make_node(op: str, inputs: tuple[str, ...] | list[str], outputs: tuple[str, ...] | list[str],
              input_types: list[TensorType], attrs: Mapping[str, Any] | None = None) -> Node:
    """A node whose attributes are checked against its op's schema and whose types are inferred."""
    opdef = get_op(op)
    normalized = opdef.normalize_attrs(attrs or {})
    types = opdef.infer_types(input_types, normalized)
    if len(outputs) != len(types):
        raise ValueError(f"{op}: {len(outputs)} output names for {len(types)} outputs")
    return Node(op, tuple(inputs), tuple(outputs), tuple(types), FrozenAttrs(normalized))
