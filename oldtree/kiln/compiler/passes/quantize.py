"""Quantizing the GEMMs' weights to the compile's quantization method (``kiln.compiler.quantization``).

Each linear-family node's weight becomes the method's stored parameter and scales (a ``Quantize``
recipe makes them from the plain weight when the artifact is written), and the node says how it
treats its activations (``act_quant``, for the W8A8 methods). The plain weights it replaced go.

Before:  %y = linear_residual(%x, @l.o.weight, %r)
After:   %y = linear_residual(%x, @l.o.weight.q, %r) {act_quant="int8_per_token"}
         param @l.o.weight.q: i8[8, 16] format=int8_channel(@l.o.weight.q.scale)

Left plain: the embedding (not a GEMM), the lm_head (the GEMM the step's ``logits`` output comes
from, through a cast: the logits decide every sampled token) unless ``quantize_lm_head`` asks for
it, any weight something other than the method's ops reads (a tied embedding) and weights whose
shape the scheme cannot hold (an MXFP4 row that is no whole number of blocks of 32). With
``quantize_lm_head`` a tied lm_head reads a quantized copy of the embedding table, which the
embedding still reads plain: more memory, fewer bytes read a step (the head is the largest GEMM of a
decode step of a model with a large vocabulary: 7% of Llama-3-8B's bf16 weights, half that share
of the bytes again once the layers are FP8). Runs after the fusions, which join plain weights by
``Concat`` recipes the ``Quantize`` recipe then reads, and before kernel selection, which picks the
quantized kernels by the weight's format.
"""

from __future__ import annotations

from kiln.ir import Graph, Node, Param, get_op, make_node
from kiln.step_schema import LOGITS

from .base import PassContext
from .patterns import Match, Replacement, Rule, op, rewrite


def quantize(graph: Graph, ctx: PassContext) -> Graph:
    method = ctx.quantization
    if method is None:
        return graph
    users = graph.users()
    head = _lm_head(graph, method.ops)
    done: dict[str, Param] = {}  # a weight several GEMMs read is quantized once

    def build(m: Match) -> Replacement | None:
        node = m.root
        index = get_op(node.op).inputs.index("weight")
        weight = graph.params.get(node.inputs[index])
        if weight is None or weight.format.quantized or weight.type.rank != 2:
            return None
        if node is head:
            if not ctx.quantize_lm_head:
                return None
        elif any(user.op not in method.ops for user in users[weight.name]):
            return None
        params: tuple[Param, ...] = ()
        recipes = ()
        if weight.name not in done:
            made = method.quantized(weight)
            if made is None:
                return None
            stored, scales, recipe = made
            done[weight.name] = stored
            params, recipes = (stored, *scales), (recipe,)
        stored = done[weight.name]
        inputs = node.inputs[:index] + (stored.name,) + node.inputs[index + 1:]
        types = [stored.value_type if i == stored.name else m.type(i) for i in inputs]
        attrs = dict(node.attrs, act_quant=method.act_quant)
        return Replacement((make_node(node.op, inputs, node.outputs, types, attrs),), params, recipes)

    result = rewrite(graph, ctx, *(Rule(op(name), build) for name in method.ops))
    read = {value for node in result.nodes for value in node.inputs}
    return result.replace(params={name: p for name, p in result.params.items()
                                  if name not in done or name in read})


def _lm_head(graph: Graph, gemms: tuple[str, ...]) -> Node | None:
    """The GEMM the ``logits`` output comes from: followed back from that output through the first
    input of the ops between (the cast to f32); None when the graph has no logits or no GEMM makes them."""
    if LOGITS.name not in graph.outputs:
        return None
    producers = graph.producers()
    node = producers.get(LOGITS.name)
    while node is not None and node.op not in gemms:
        node = producers.get(node.inputs[0]) if node.inputs else None
    return node
