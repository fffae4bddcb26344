"""Kernel selection: for each node, the registry's best implementation for the compile's backend.

An analysis pass: the graph is unchanged; ``ctx.kernel_choice[i]`` names node ``i``'s kernel.
"""

from __future__ import annotations

from kiln.ir import Graph
from kiln.kernels import select_impl

from .base import PassContext


def select_kernels(graph: Graph, ctx: PassContext) -> Graph:
    types = graph.value_types()
    ctx.kernel_choice = [
        select_impl(node.op, [types[i] for i in node.inputs], node.attrs, ctx.backend).name for node in graph.nodes
    ]
    return graph
