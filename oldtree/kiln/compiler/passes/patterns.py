"""Rewrites as data: patterns match ops by their structure, rules say what replaces a match, and one
engine applies a pass's rules to the graph.

A pattern is a tree rooted at the node a rule rewrites, written with ``op`` and ``var``:

    op("rmsnorm", op("add", var("a"), var("b"), name="add", shared=True), var("weight"), name="norm")

``op(name, *inputs)`` matches a node of that op whose inputs match ``inputs`` in order (a trailing
``...`` lets further inputs follow; no inputs given: any inputs). ``var(name)`` matches any value
and binds its name; ``var(name, optional=True)`` also an absent optional input (binding None). A
name bound twice must bind the same value, or the same node: ``output=i`` matches a node's i-th
output, so two inputs can be two outputs of one node.

The nodes a match absorbs vanish, so each must be private: read only by nodes of the match, and not
a graph output. ``shared=True`` lets a node's outputs have other readers (the replacement must make
those values again); ``keep=True`` marks context, matched and left as it is. A rule's ``build``
turns a match into its replacement (or None: leave this match), which takes the place of the root,
or of the node the rule names ``at``; the engine declines a placement where a value would be read
before it is made. ``rewrite`` tries the rules, in order, at each node in graph order;
``rewrite_siblings`` replaces groups of matches that share a key. Nodes a rewrite made or absorbed
are not matched again in the same call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping, Sequence

from kiln.ir import Graph, Node, Param, TensorType, make_node

from ..recipes import Recipe
from .base import PassContext


@dataclass(frozen=True)
class Pattern:
    op: str | None  # None: a variable
    inputs: tuple[Pattern, ...] | None = None  # None: any inputs
    name: str | None = None
    output: int = 0
    more: bool = False  # further inputs may follow the matched ones
    shared: bool = False
    keep: bool = False
    optional: bool = False


def op(op_name: str, *inputs: Any, name: str | None = None, output: int = 0, shared: bool = False,
       keep: bool = False) -> Pattern:
    more = bool(inputs) and inputs[-1] is ...
    patterns = tuple(inputs[:-1] if more else inputs)
    return Pattern(op_name, patterns if inputs else None, name, output, more, shared, keep)


def var(name: str, optional: bool = False) -> Pattern:
    return Pattern(None, name=name, optional=optional)


@dataclass
class Match:
    """What a pattern bound: ``m["x"]`` a variable's value (None: an absent optional input),
    ``m.nodes["norm"]`` a named node, ``m.root`` the node at the pattern's root."""

    root: Node
    types: Mapping[str, TensorType]
    nodes: dict[str, Node] = field(default_factory=dict)
    values: dict[str, str | None] = field(default_factory=dict)
    # Every matched node with the pattern that matched it, by node id.
    matched: dict[int, tuple[Node, Pattern]] = field(default_factory=dict)

    def __getitem__(self, name: str) -> str | None:
        return self.values[name]

    def type(self, value: str) -> TensorType:
        return self.types[value]

    def make(self, op_name: str, inputs: Sequence[str | None], outputs: Sequence[str],
             attrs: Mapping[str, Any] | None = None) -> Node:
        """A new node, typed from its inputs; None inputs (absent optional ones) are left out."""
        present = [i for i in inputs if i is not None]
        return make_node(op_name, present, outputs, [self.types[i] for i in present], attrs)


@dataclass(frozen=True)
class Replacement:
    """What replaces a match: new nodes, and the parameters they bring with the recipes making those."""

    nodes: tuple[Node, ...]
    params: tuple[Param, ...] = ()
    recipes: tuple[Recipe, ...] = ()


@dataclass(frozen=True)
class Rule:
    pattern: Pattern
    build: Callable[[Match], Node | Replacement | None]
    at: str | None = None


def rewrite(graph: Graph, ctx: PassContext, *rules: Rule) -> Graph:
    """Tries ``rules`` in order at each node, in graph order; the first that matches and builds rewrites it."""
    state = _Rewriter(graph, ctx)
    for root in graph.nodes:
        for rule in rules:
            match = state.match(rule.pattern, root)
            replacement = None if match is None else rule.build(match)
            if replacement is not None and state.apply([match], replacement, match.nodes[rule.at] if rule.at else root):
                break
    return state.result()


def rewrite_siblings(graph: Graph, ctx: PassContext, pattern: Pattern, key: Callable[[Match], Hashable | None],
                     build: Callable[[list[Match]], Node | Replacement | None]) -> Graph:
    """Groups the matches of ``pattern`` by ``key`` (None: no group); ``build`` replaces each group of
    two or more, in the place of its first member."""
    state = _Rewriter(graph, ctx)
    groups: dict[Hashable, list[Match]] = {}
    for node in graph.nodes:
        match = state.match(pattern, node)
        group = None if match is None else key(match)
        if group is not None:
            groups.setdefault(group, []).append(match)
    for members in groups.values():
        replacement = build(members) if len(members) > 1 else None
        if replacement is not None:
            state.apply(members, replacement, members[0].root)
    return state.result()


class _Rewriter:
    """The graph being rewritten: which node makes and which nodes read each value, and where each
    runs (a replacement where the node it replaced ran), kept current as rewrites apply."""

    def __init__(self, graph: Graph, ctx: PassContext) -> None:
        self.graph = graph
        self.ctx = ctx
        self.params = dict(graph.params)
        self.types = graph.value_types()
        self.position = {id(n): i for i, n in enumerate(graph.nodes)}
        self.producers = {out: n for n in graph.nodes for out in n.outputs}
        self.readers: dict[str, list[Node]] = {}
        for node in graph.nodes:
            for value in node.inputs:
                self.readers.setdefault(value, []).append(node)
        self.placed: dict[int, tuple[Node, ...]] = {}  # a replaced node's id -> the nodes in its place
        self.gone: set[int] = set()
        self.done: set[int] = set()  # nodes a rewrite made or matched: not matched again

    def result(self) -> Graph:
        if not self.placed:
            return self.graph
        nodes: list[Node] = []
        for node in self.graph.nodes:
            if id(node) in self.placed:
                nodes.extend(self.placed[id(node)])
            elif id(node) not in self.gone:
                nodes.append(node)
        return self.graph.replace(nodes=nodes, params=self.params)

    def match(self, pattern: Pattern, root: Node) -> Match | None:
        match = Match(root, self.types)
        if not self._bind_node(pattern, root, match) or not self._private(match):
            return None
        return match

    def _bind_node(self, pattern: Pattern, node: Node, match: Match) -> bool:
        if id(node) in self.done or node.op != pattern.op:
            return False
        if pattern.name is not None:
            if pattern.name in match.nodes:
                return match.nodes[pattern.name] is node
            match.nodes[pattern.name] = node
        match.matched[id(node)] = (node, pattern)
        if pattern.inputs is None:
            return True
        required = sum(1 for p in pattern.inputs if not p.optional)
        if len(node.inputs) < required or (not pattern.more and len(node.inputs) > len(pattern.inputs)):
            return False
        return all(self._bind_value(p, node.inputs[i] if i < len(node.inputs) else None, match)
                   for i, p in enumerate(pattern.inputs))

    def _bind_value(self, pattern: Pattern, value: str | None, match: Match) -> bool:
        if pattern.op is None:
            if value is None and not pattern.optional:
                return False
            if pattern.name in match.values:
                return match.values[pattern.name] == value
            match.values[pattern.name] = value
            return True
        producer = None if value is None else self.producers.get(value)
        if producer is None or pattern.output >= len(producer.outputs) or producer.outputs[pattern.output] != value:
            return False
        return self._bind_node(pattern, producer, match)

    def _private(self, match: Match) -> bool:
        for node, pattern in match.matched.values():
            if node is match.root or pattern.shared or pattern.keep:
                continue
            for out in node.outputs:
                if out in self.graph.outputs or any(id(r) not in match.matched for r in self.readers.get(out, [])):
                    return False
        return True

    def apply(self, matches: Sequence[Match], replacement: Node | Replacement, at: Node) -> bool:
        """Replaces the matches' nodes (but kept ones) by ``replacement``, placed where ``at`` was;
        False, changing nothing, when the placement is out of order or a node was rewritten already."""
        if isinstance(replacement, Node):
            replacement = Replacement((replacement,))
        entries = [entry for m in matches for entry in m.matched.values()]
        if any(id(node) in self.done for node, _ in entries):
            return False
        gone = {id(node) for node, pattern in entries if not pattern.keep}
        if id(at) not in gone:
            raise ValueError(f"a replacement takes the place of a node it rewrites, not of kept {at.op} {at.outputs}")
        made = {out for node in replacement.nodes for out in node.outputs}
        for node, _ in entries:
            for out in node.outputs:
                if id(node) in gone and out not in made and self._read_outside(out, gone):
                    raise ValueError(f"rewrite at {at.op} -> {at.outputs} drops {out!r}, which is still read")
        if not self._in_order(replacement.nodes, gone, at):
            return False
        place = self.position[id(at)]
        for node, _ in entries:
            if id(node) in gone:
                for value in node.inputs:
                    self.readers[value] = [r for r in self.readers[value] if r is not node]
                for out in node.outputs:
                    del self.producers[out]
        for node in replacement.nodes:
            self.position[id(node)] = place
            self.producers.update((out, node) for out in node.outputs)
            self.types.update(zip(node.outputs, node.types))
            for value in node.inputs:
                self.readers.setdefault(value, []).append(node)
        self.params.update((p.name, p) for p in replacement.params)
        self.types.update((p.name, p.value_type) for p in replacement.params)
        for recipe in replacement.recipes:
            self.ctx.add_recipe(recipe)
        self.placed[id(at)] = replacement.nodes
        self.gone |= gone
        self.done.update(id(node) for node in (*(n for n, _ in entries), *replacement.nodes))
        return True

    def _read_outside(self, value: str, gone: set[int]) -> bool:
        return value in self.graph.outputs or any(id(r) not in gone for r in self.readers.get(value, []))

    def _in_order(self, new: Sequence[Node], gone: set[int], at: Node) -> bool:
        """Whether ``new``, placed where ``at`` is, reads only values made before it and makes values
        nobody before it reads."""
        place = self.position[id(at)]
        made: set[str] = set()
        for node in new:
            for value in node.inputs:
                producer = self.producers.get(value)
                if value not in made and producer is not None and (
                        id(producer) in gone or self.position[id(producer)] > place):
                    return False
            made.update(node.outputs)
        return not any(id(r) not in gone and self.position[id(r)] < place
                       for value in made for r in self.readers.get(value, []))
