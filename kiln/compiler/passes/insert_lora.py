"""Adding LoRA hooks to the GEMMs an adapter may target (``CompileOptions.lora_target_modules``).

Each targeted GEMM gets a hook of two ops (``kiln/ir/ops_lora.py``): ``lora_shrink`` just before it,
from the GEMM's input, on the step's side stream (so it runs while the GEMM does), and
``lora_expand`` after it, adding the update of each sequence's adapter to the output in place; the
GEMM itself and its weights are untouched, so every adapter shares the base model's (fused,
quantized) weights. A fused GEMM (q/k/v, gate/up: ``fuse_linears``'
``Concat`` recipe names its members) takes one hook whose slices are its members, in order. The
stacked adapter weights of each hook are two graph inputs, ``lora_a.<module>`` and
``lora_b.<module>``, held by the runtime's adapter slots, not by the artifact's weights; the pass
records them in ``ctx.lora`` (a ``LoraLayout``) for the manifest.

The step's token rows are grouped by adapter once, by a ``lora_groups`` op before the first hook,
and every hook reads that grouping (``lora_rows``, ``lora_tiles``): the hooks' kernels take tiles
of one adapter's rows without each working out which rows those are.

Before:  %o = linear_residual(%attn, @l.o_proj.weight, %h)
After:   %lora_rows, %lora_tiles = lora_groups(%lora_slot, %q_start, %q_len) {slots=L}
         %o.lora_h = lora_shrink(%attn, %lora_a.l.o_proj, %lora_rows, %lora_tiles)
         %o.base = linear_residual(%attn, @l.o_proj.weight, %h)
         %o = lora_expand(%o.base, %o.lora_h, %lora_b.l.o_proj, %lora_rows, %lora_tiles) {slices=[H]}

Runs after the residual adds joined their GEMMs (the update is a sum, so it adds onto the residual
GEMM's output alike) and before the norm and the gated activation join the GEMMs after them. A
hook on a GEMM whose input an RMSNorm or SiLU·mul makes reads that op's input instead (``prologue``:
the shrink makes the GEMM input itself), so the op stays private to its GEMM and still joins it.
"""

from __future__ import annotations

from kiln.ir import Graph, Node, TensorType, make_node
from kiln.lora_layout import SLOT_FIELD, LoraHook, LoraSlice

from ..recipes import Concat
from .base import PassContext

HOOKED_OPS = ("linear", "linear_residual")
GROUPS = ("lora_rows", "lora_tiles")  # the lora_groups op's outputs, which every hook reads


def insert_lora(graph: Graph, ctx: PassContext) -> Graph:
    layout = ctx.lora
    if layout is None:
        return graph
    members = {r.output: r.inputs for r in ctx.recipes if isinstance(r, Concat)}
    users = graph.users()
    producers = graph.producers()
    types = graph.value_types()
    inputs = dict(graph.inputs)
    nodes: list[Node] = []
    hooks: list[LoraHook] = []
    for node in graph.nodes:
        weight = node.inputs[1] if node.op in HOOKED_OPS else None
        modules = [name.removesuffix(".weight") for name in members.get(weight, (weight,))] if weight else []
        if not any(m.rsplit(".", 1)[-1] in layout.target_modules for m in modules):
            nodes.append(node)
            continue
        x, out = node.inputs[0], node.out
        widths = _slice_widths(node, modules, users.get(out, []))
        module = weight.removesuffix(".weight")
        hook = LoraHook(f"lora_a.{module}", f"lora_b.{module}",
                        tuple(LoraSlice(m, types[x].shape[1], w) for m, w in zip(modules, widths)))
        dtype = types[x].dtype
        inputs[hook.a_input] = TensorType((layout.max_loras, len(widths) * layout.max_rank, hook.in_features), dtype)
        inputs[hook.b_input] = TensorType((layout.max_loras, hook.out_features, layout.max_rank), dtype)
        base = Node(node.op, node.inputs, (f"{out}.base",), node.types, node.attrs)
        source, extra, attrs = _prologue(x, producers, users)
        if not hooks:
            group_inputs = [SLOT_FIELD, "q_start", "q_len"]
            groups = make_node("lora_groups", group_inputs, list(GROUPS), [inputs[i] for i in group_inputs],
                               {"slots": layout.max_loras})
            nodes.append(groups)
            types.update(zip(GROUPS, groups.types))
        shrink_inputs = [source, hook.a_input, *GROUPS, *extra]
        shrink = make_node("lora_shrink", shrink_inputs, [f"{out}.lora_h"],
                           [types.get(i, inputs.get(i)) for i in shrink_inputs], attrs)
        expand_inputs = [base.out, shrink.out, hook.b_input, *GROUPS]
        expand = make_node("lora_expand", expand_inputs, [out],
                           [base.type, *shrink.types, *(types.get(i, inputs.get(i)) for i in expand_inputs[2:])],
                           {"slices": widths})
        nodes += [shrink, base, expand]
        hooks.append(hook)
    ctx.lora = type(layout)(layout.max_loras, layout.max_rank, layout.target_modules, tuple(hooks))
    return graph.replace(inputs=inputs, nodes=nodes)


def _prologue(x: str, producers: dict[str, Node], users: dict[str, list[Node]]) -> tuple[str, list[str], dict]:
    """What the hook reads for the GEMM input ``x``: the input of the RMSNorm or gated activation that
    makes it (which can then still join the GEMM), or ``x`` itself."""
    made_by = producers.get(x)
    if made_by is not None and made_by.op == "rmsnorm" and len(users[x]) == 1:
        return made_by.inputs[0], [made_by.inputs[1]], {"prologue": "rmsnorm", "eps": made_by.attrs["eps"]}
    if made_by is not None and made_by.op == "silu_mul" and len(users[x]) == 1:
        split = producers.get(made_by.inputs[0])
        if split is not None and split.op == "split" and tuple(split.outputs) == tuple(made_by.inputs) and \
                split.attrs["sizes"][0] == split.attrs["sizes"][1]:
            return split.inputs[0], [], {"prologue": "silu_mul"}
    return x, [], {}


def _slice_widths(node: Node, modules: list[str], readers: list[Node]) -> list[int]:
    """The output widths of a GEMM's members: the split after a fused GEMM says them."""
    if len(modules) == 1:
        return [node.type.shape[1]]
    splits = [r for r in readers if r.op == "split" and len(r.attrs["sizes"]) == len(modules)]
    if not splits:
        raise ValueError(f"insert_lora: fused GEMM {node.out} of {', '.join(modules)} has no split into its members")
    return list(splits[0].attrs["sizes"])

