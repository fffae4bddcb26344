"""Kernel selection: for each node, a kernel generated for its shape (``triton`` backend, fused ops
codegen knows) or else the registry's best implementation for the compile's backend.

An analysis pass: the graph is unchanged; ``ctx.kernel_choice[i]`` names node ``i``'s kernel and
``ctx.generated_kernels`` holds the sources codegen made.
"""

from __future__ import annotations

from kiln.ir import Graph
from kiln.kernels import select_impl

from ..codegen.triton_fused import generated_kernel
from .base import PassContext


def select_kernels(graph: Graph, ctx: PassContext) -> Graph:
    types = graph.value_types()
    ctx.kernel_choice = []
    for node in graph.nodes:
        input_types = [types[i] for i in node.inputs]
        generated = generated_kernel(node, input_types) if ctx.backend == "triton" else None
        if generated is not None:
            name, source = generated
            ctx.generated_kernels[name] = (node.op, source)
            ctx.kernel_choice.append(name)
        else:
            ctx.kernel_choice.append(select_impl(node.op, input_types, node.attrs, ctx.backend).name)
    return graph
