"""GraphBuilder: how model files (and tests) write graphs, one op call at a time.

Each ``op`` call checks attributes and infers types at once, so a model that builds without error
is well typed. Values are plain names; ``name=`` gives a readable one instead of a number.
"""

from __future__ import annotations

from typing import Any

from .graph import FrozenAttrs, Graph, Node, Param
from .ops import get_op
from .types import TensorType
from .weights import PLAIN, REPLICATED, Placement, WeightFormat


class GraphBuilder:
    def __init__(self, name: str) -> None:
        self.name = name
        self._inputs: dict[str, TensorType] = {}
        self._params: dict[str, Param] = {}
        self._nodes: list[Node] = []
        self._types: dict[str, TensorType] = {}
        self._outputs: list[str] = []
        self._counter = 0

    def input(self, name: str, type: TensorType) -> str:
        self._claim(name, type)
        self._inputs[name] = type
        return name

    def param(self, name: str, type: TensorType, format: WeightFormat = PLAIN,
              placement: Placement = REPLICATED) -> str:
        """Declares a parameter; declaring the same one twice returns it (tied weights)."""
        param = Param(name, type, format, placement)
        if name in self._params:
            if self._params[name] != param:
                raise ValueError(f"parameter {name} declared twice, differently: {self._params[name]} and {param}")
            return name
        self._claim(name, param.value_type)
        self._params[name] = param
        return name

    def op(self, op: str, *inputs: str, name: str | None = None, names: tuple[str, ...] | None = None,
           **attrs: Any) -> Any:
        """Appends a node; returns its value's name, or a tuple of names for a multi-output op.
        ``name`` is a hint (numbered on clashes; ``name.i`` for each output of a multi-output op);
        ``names`` gives every output's exact name."""
        opdef = get_op(op)
        normalized = opdef.normalize_attrs(attrs)
        types = opdef.infer_types([self.type_of(i) for i in inputs], normalized)
        if names is None:
            hints = [name] if len(types) == 1 else [None if name is None else f"{name}.{i}" for i in range(len(types))]
            names = tuple(self._fresh(h) for h in hints)
        elif len(names) != len(types):
            raise ValueError(f"{op}: {len(names)} output names for {len(types)} outputs")
        node = Node(op, tuple(inputs), tuple(names), types, FrozenAttrs(normalized))
        for out, t in zip(node.outputs, node.types):
            self._claim(out, t)
        self._nodes.append(node)
        return node.outputs[0] if len(node.outputs) == 1 else node.outputs

    def output(self, *names: str) -> None:
        for n in names:
            self.type_of(n)
            self._outputs.append(n)

    def type_of(self, name: str) -> TensorType:
        try:
            return self._types[name]
        except KeyError:
            raise KeyError(f"no value named {name!r} in graph {self.name}") from None

    def build(self) -> Graph:
        if not self._outputs:
            raise ValueError(f"graph {self.name} has no outputs")
        return Graph(self.name, dict(self._inputs), dict(self._params), tuple(self._nodes), tuple(self._outputs))

    def _claim(self, name: str, type: TensorType) -> None:
        if name in self._types:
            raise ValueError(f"value name {name!r} is used twice in graph {self.name}")
        self._types[name] = type

    def _fresh(self, hint: str | None) -> str:
        if hint is not None and hint not in self._types:
            return hint
        while True:
            candidate = f"{hint}_{self._counter}" if hint else str(self._counter)
            self._counter += 1
            if candidate not in self._types:
                return candidate
