"""Static memory planning: every intermediate value gets a fixed offset in one arena, with reuse.

Sizes are taken at the compile's symbol bounds (``T`` = max batch tokens, ``B`` = max sequences,
``N`` = max logit rows, ...), so any step within the bounds fits. A value's lifetime runs from the
node that makes it to its last reader (graph outputs: to the end); views (``reshape``/``split``)
and in-place updates share their root's storage and extend its lifetime. Placement is greedy,
largest first, each at the lowest aligned offset free of every overlapping lifetime. The step then
never allocates, which is what CUDA-graph capture needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.ir import Graph, get_op

from .base import PassContext

ALIGNMENT = 256


@dataclass(frozen=True)
class MemoryPlan:
    arena_bytes: int
    offsets: dict[str, int]        # root value -> byte offset
    roots: dict[str, str]          # every arena-backed or aliasing value -> the value owning its storage
    bounds: dict[str, int]

    def to_json(self) -> dict:
        return {"arena_bytes": self.arena_bytes, "offsets": self.offsets, "roots": self.roots, "bounds": self.bounds}


def plan_memory(graph: Graph, ctx: PassContext) -> Graph:
    roots: dict[str, str] = {}
    defined_at: dict[str, int] = {}
    for index, node in enumerate(graph.nodes):
        opdef = get_op(node.op)
        for i, out in enumerate(node.outputs):
            alias = opdef.output_alias(i)
            if alias is None:
                roots[out] = out
                defined_at[out] = index
            else:
                source = node.inputs[alias]
                # Aliases of graph inputs (the KV pool) live outside the arena.
                if source in roots:
                    roots[out] = roots[source]
    last_use = dict(defined_at)
    for index, node in enumerate(graph.nodes):
        for name in node.inputs:
            if name in roots:
                root = roots[name]
                last_use[root] = max(last_use[root], index)
    end = len(graph.nodes)
    for out in graph.outputs:
        if out in roots:
            last_use[roots[out]] = end
    types = graph.value_types()
    sizes = {root: _aligned(types[root].nbytes(ctx.symbol_bounds)) for root in defined_at}
    placed: list[tuple[int, int, int, int]] = []  # (offset, size, start, end)
    offsets: dict[str, int] = {}
    for root in sorted(defined_at, key=lambda r: (-sizes[r], defined_at[r])):
        start, stop = defined_at[root], last_use[root]
        offset = _lowest_fit(placed, sizes[root], start, stop)
        offsets[root] = offset
        placed.append((offset, sizes[root], start, stop))
    arena = max((o + s for o, s, _, _ in placed), default=0)
    ctx.memory_plan = MemoryPlan(arena, offsets, roots, dict(ctx.symbol_bounds))
    return graph


def _aligned(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _lowest_fit(placed: list[tuple[int, int, int, int]], size: int, start: int, stop: int) -> int:
    busy = sorted((o, o + s) for o, s, a, b in placed if a <= stop and start <= b)
    offset = 0
    for lo, hi in busy:
        if offset + size <= lo:
            break
        offset = max(offset, hi)
    return offset
