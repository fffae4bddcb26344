"""An FP8 KV cache (``CompileOptions.kv_cache_dtype = "fp8_e4m3"``): the pool's graph inputs become
f8e4m3, and every op that stores into a layer's pool or reads it carries that layer's scales.

Before:  input %kc: bf16[NS, 2, 8]
         %kc2, %vc2 = kv_store(%kc, %vc, %k, %v, %slots) : bf16[NS, 2, 8], bf16[NS, 2, 8]
         %a = paged_attention(%q, %kc2, %vc2, ...) {page_size=4, scale=0.35, ...}
After:   input %kc: f8e4m3[NS, 2, 8]
         %kc2, %vc2 = kv_store(%kc, %vc, %k, %v, %slots) {k_scale=1.0, v_scale=1.0} : f8e4m3[NS, 2, 8], ...
         %a = paged_attention(%q, %kc2, %vc2, ...) {..., k_scale=1.0, v_scale=1.0}

Scales are per tensor: one for a layer's K and one for its V (the pool stores k / k_scale), 1.0 each
unless ``CompileOptions.kv_cache_scales`` gives calibrated ones, a (k, v) pair per layer in the order
the layers store (vLLM's default and its per-layer checkpoint scales). Layers are found by the ops
that store into a pool (``kv_store`` and its fusions), never by names. Runs after the fusions, which
build fused nodes without these attributes, and before kernel selection, which picks kernels that
read FP8.
"""

from __future__ import annotations

from kiln.ir import DType, Graph, get_op, make_node

from .base import PassContext

STORES = ("kv_store", "rope_kv_store", "rope_kv_attention")  # ops whose k_cache/v_cache inputs are a layer's pool
READERS = ("paged_attention",)  # ops that read a pool a store returned
KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": DType.f8e4m3}


def quantize_kv_cache(graph: Graph, ctx: PassContext) -> Graph:
    dtype = KV_CACHE_DTYPES[ctx.kv_cache_dtype]
    if dtype is None:
        return graph
    stores = [node for node in graph.nodes if node.op in STORES]
    scales = ctx.kv_cache_scales or ((1.0, 1.0),) * len(stores)
    if len(scales) != len(stores):
        raise ValueError(f"kv_cache_scales has {len(scales)} (k, v) pairs; the model has {len(stores)} layers")
    attrs_of: dict[str, dict[str, float]] = {}  # a pool value (input, or a store's output) -> its layer's scales
    pools: set[str] = set()
    for node, (k_scale, v_scale) in zip(stores, scales):
        layer = {"k_scale": float(k_scale), "v_scale": float(v_scale)}
        inputs = get_op(node.op).inputs
        for name in ("k_cache", "v_cache"):
            pool = node.inputs[inputs.index(name)]
            if pool not in graph.inputs:
                raise ValueError(f"{node.op} stores into {pool}, which is no graph input: cannot make it {dtype}")
            pools.add(pool)
            attrs_of[pool] = layer
        attrs_of.update((out, layer) for out in node.outputs)
    inputs = {name: t.with_dtype(dtype) if name in pools else t for name, t in graph.inputs.items()}
    types = graph.replace(inputs=inputs).value_types()
    nodes = []
    for node in graph.nodes:
        attrs = dict(node.attrs)
        if node.op in STORES or node.op in READERS:
            pool = node.inputs[get_op(node.op).inputs.index("k_cache")]
            attrs.update(attrs_of.get(pool, {}))
        made = make_node(node.op, node.inputs, node.outputs, [types[i] for i in node.inputs], attrs)
        types.update(zip(made.outputs, made.types))
        nodes.append(made)
    return graph.replace(inputs=inputs, nodes=nodes)
