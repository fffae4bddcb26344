"""What passes share: the context they run in, with the weight recipes they leave for the artifact writer.

A pass is ``fn(graph, ctx) -> graph``. When it changes what a parameter holds (fusing q/k/v
concatenates three weights), it adds a recipe for the new parameter to ``ctx`` (``kiln.compiler.recipes``);
the weight store applies them when the artifact is written, so passes never touch tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from kiln.ir import Graph, Node

from ..recipes import Recipe


@dataclass
class PassContext:
    backend: str = "torch"
    symbol_bounds: dict[str, int] = field(default_factory=dict)
    recipes: list[Recipe] = field(default_factory=list)
    # Results of the analysis passes, read by codegen and the manifest.
    kernel_choice: list[str] = field(default_factory=list)
    generated_kernels: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (op, source)
    memory_plan: Any = None

    def add_recipe(self, recipe: Recipe) -> None:
        made = set(recipe.outputs).intersection(name for earlier in self.recipes for name in earlier.outputs)
        if made:
            raise ValueError(f"weight(s) {sorted(made)} are made twice")
        self.recipes.append(recipe)


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


def fold_operand_producers(graph: Graph, op: str, producer_op: str, sides: tuple[int, int],
                           fold: Callable[[Node, Node, str], Node | None]) -> Graph:
    """Folds into each two-input ``op`` node the ``producer_op`` node that makes one of its operands for
    it alone: ``fold(node, producer, other_operand)`` returns the fused node (placed where ``node``
    was; the producer is dropped) or None to leave that pairing. Operand ``sides[0]`` is tried first,
    then ``sides[1]``; a producer is folded once."""
    producers = graph.producers()
    users = graph.users()
    replaced: dict[int, Node] = {}
    absorbed: set[int] = set()
    for node in graph.nodes:
        if node.op != op:
            continue
        for side in sides:
            producer = producers.get(node.inputs[side])
            if (producer is None or producer.op != producer_op or id(producer) in absorbed
                    or sole_reader(graph, users, producer.out) is None):
                continue
            fused = fold(node, producer, node.inputs[1 - side])
            if fused is not None:
                replaced[id(node)] = fused
                absorbed.add(id(producer))
                break
    return rewrite_nodes(graph, replaced, absorbed)

