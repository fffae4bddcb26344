"""Static memory planning: every intermediate value gets a fixed offset in one arena, with reuse.

Sizes are taken at the compile's symbol bounds (``T`` = max batch tokens, ``B`` = max sequences,
``N`` = max logit rows, ...), so any step within the bounds fits. A value's lifetime runs from the
node that makes it to its last reader (graph outputs: to the end; what a side-stream op reads or
writes: to at least its join, the first op after it that reads its output, since until then it may
still be running beside the ops between); views (``reshape``/``split``)
and in-place updates share their root's storage and extend its lifetime. An output an op lets
reuse an input (``OpDef.reuses``: the residual GEMMs' residual) takes that input's storage over
when the node is the last reader of all of it. Placement is greedy, largest first, each at the
lowest aligned offset free of every overlapping lifetime. The step then never allocates, which is
what CUDA-graph capture needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.ir import Graph, Node, TensorType, get_op

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


@dataclass
class _Storage:
    """The arena storage being assigned: each value's root, where each root is made, how long each
    root lives (its members' last reader), and the values that span their root whole."""
    roots: dict[str, str]
    defined_at: dict[str, int]
    last_use: dict[str, int]
    whole: set[str]


def plan_memory(graph: Graph, ctx: PassContext) -> Graph:
    storage = _assign_storage(graph)
    types = graph.value_types()
    sizes = {root: _aligned(types[root].nbytes(ctx.symbol_bounds)) for root in storage.defined_at}
    placed: list[tuple[int, int, int, int]] = []  # (offset, size, start, end)
    offsets: dict[str, int] = {}
    for root in sorted(storage.defined_at, key=lambda r: (-sizes[r], storage.defined_at[r])):
        start, stop = storage.defined_at[root], storage.last_use[root]
        offset = _lowest_fit(placed, sizes[root], start, stop)
        offsets[root] = offset
        placed.append((offset, sizes[root], start, stop))
    arena = max((o + s for o, s, _, _ in placed), default=0)
    ctx.memory_plan = MemoryPlan(arena, offsets, storage.roots, dict(ctx.symbol_bounds))
    return graph


def _assign_storage(graph: Graph) -> _Storage:
    reads = _last_readers(graph)
    types = graph.value_types()
    storage = _Storage({}, {}, {}, set())
    for index, node in enumerate(graph.nodes):
        opdef = get_op(node.op)
        for i, out in enumerate(node.outputs):
            alias = opdef.output_alias(i)
            if alias is not None:
                source = node.inputs[alias]
                # Aliases of graph inputs (the KV pool) live outside the arena.
                if source in storage.roots:
                    _join(storage, out, storage.roots[source], reads[out])
                continue
            root = _dying_input_root(node, opdef.output_reuse(i), index, types[out], types, storage)
            if root is None:
                storage.defined_at[out] = index
                storage.last_use[out] = reads[out]
                storage.roots[out] = out
            else:
                _join(storage, out, root, reads[out])
            storage.whole.add(out)
    return storage


def _last_readers(graph: Graph) -> dict[str, int]:
    """Each value's last reader (its maker if none reads it; graph outputs: past the last node), a
    side-stream op's operands counted as read at its join."""
    last: dict[str, int] = {}
    for index, node in enumerate(graph.nodes):
        for name in (*node.inputs, *node.outputs):
            last[name] = index
    for index, node in enumerate(graph.nodes):
        if get_op(node.op).side_stream:
            join = _side_stream_join(graph, index)
            for name in (*node.inputs, *node.outputs):
                last[name] = max(last[name], join)
    for out in graph.outputs:
        last[out] = len(graph.nodes)
    return last


def _side_stream_join(graph: Graph, index: int) -> int:
    """Where the side-stream op at ``index`` is waited for: the first later op on the main stream that
    reads one of its outputs (past the last node if none does: the step's end)."""
    made = set(graph.nodes[index].outputs)
    for later in range(index + 1, len(graph.nodes)):
        node = graph.nodes[later]
        if not get_op(node.op).side_stream and made.intersection(node.inputs):
            return later
    return len(graph.nodes)


def _join(storage: _Storage, value: str, root: str, last_read: int) -> None:
    storage.roots[value] = root
    storage.last_use[root] = max(storage.last_use[root], last_read)


def _dying_input_root(node: Node, input_index: int | None, index: int, out_type: TensorType,
                      types: dict[str, TensorType], storage: _Storage) -> str | None:
    """The root an output may take over: its reusable input's, when that input spans the root whole
    and has the output's type, nothing reads the root after this node, and no other input of the
    node lives in it (the kernel reads those while it writes the output)."""
    if input_index is None:
        return None
    name = node.inputs[input_index]
    root = storage.roots.get(name)
    if root is None or name not in storage.whole or types[name] != out_type or storage.last_use[root] != index:
        return None
    others = (other for j, other in enumerate(node.inputs) if j != input_index)
    if any(storage.roots.get(other) == root for other in others):
        return None
    return root


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
