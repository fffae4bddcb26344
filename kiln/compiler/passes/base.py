"""What passes share: the context they run in and the weight recipes they leave for the artifact writer.

A pass is ``fn(graph, ctx) -> graph``. When it changes what a parameter holds (fusing q/k/v
concatenates three weights), it records a ``WeightRecipe`` for the new parameter in ``ctx``; the
weight store applies recipes when the artifact is written, so passes never touch tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from kiln.ir import Graph, Node


@dataclass(frozen=True)
class WeightRecipe:
    """How to make a parameter from others: ``concat`` along ``dim`` (more kinds come with sharding
    and quantization)."""

    kind: str
    sources: tuple[str, ...]
    args: tuple[tuple[str, Any], ...] = ()

    def arg(self, name: str) -> Any:
        return dict(self.args)[name]


@dataclass
class PassContext:
    backend: str = "torch"
    symbol_bounds: dict[str, int] = field(default_factory=dict)
    recipes: dict[str, WeightRecipe] = field(default_factory=dict)
    # Results of the analysis passes, read by codegen and the manifest.
    kernel_choice: list[str] = field(default_factory=list)
    generated_kernels: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (op, source)
    memory_plan: Any = None

    def derive_weight(self, name: str, recipe: WeightRecipe) -> None:
        if name in self.recipes:
            raise ValueError(f"weight {name} is derived twice")
        self.recipes[name] = recipe


Pass = Callable[[Graph, PassContext], Graph]


def sole_reader(graph: Graph, users: dict[str, list[Node]], value: str) -> Node | None:
    """The one node reading ``value`` (``users`` is ``graph.users()``), or None when it has another
    reader or none, or is a graph output: the condition for folding its producer into that reader."""
    readers = users.get(value, [])
    return readers[0] if len(readers) == 1 and value not in graph.outputs else None


def rewrite_nodes(graph: Graph, replaced: dict[int, Node], removed: set[int]) -> Graph:
    """``graph`` with each node whose ``id`` keys ``replaced`` swapped for its replacement, in place,
    and the nodes whose ids are in ``removed`` dropped: how the fusion passes apply their matches."""
    if not replaced and not removed:
        return graph
    return graph.replace(nodes=[replaced.get(id(n), n) for n in graph.nodes if id(n) not in removed])
