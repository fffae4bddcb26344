"""Draft-tree attention: every attention of a graph with a ``tree_mask`` step input reads it.

A speculative verify step checks a draft tree in one forward: the tree's nodes sit side by side in
the context, each seeing only its own ancestors, which the per-token mask says
(``kernels/attention.py``). The model builds plain causal attention; when the options ask for tree
attention (``CompileOptions.tree_attention`` adds the ``tree_mask`` field to the step schema, so the
graph has that input) this pass hands the mask to each ``paged_attention``.

Before:  %a = paged_attention(%q, %kc, %vc, %q_start, %q_len, %kv_len, %page_table) {...}
After:   %a = paged_attention(%q, %kc, %vc, %q_start, %q_len, %kv_len, %page_table, %tree_mask) {...}

Runs before the fusions: ``fuse_rope_attention`` carries the mask into ``rope_kv_attention``.
"""

from __future__ import annotations

from kiln.ir import Graph, get_op, make_node
from kiln.step_schema import TREE_MASK

from .base import PassContext


def tree_attention(graph: Graph, ctx: PassContext) -> Graph:
    if TREE_MASK.name not in graph.inputs:
        return graph
    types = graph.value_types()
    nodes = []
    for node in graph.nodes:
        if node.op == "paged_attention" and get_op(node.op).input_named(node.inputs, "tree_mask") is None:
            inputs = [*node.inputs, TREE_MASK.name]
            node = make_node(node.op, inputs, node.outputs, [types[i] for i in inputs], node.attrs)
        nodes.append(node)
    return graph.replace(nodes=nodes)
