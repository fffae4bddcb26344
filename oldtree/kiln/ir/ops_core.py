"""Primitive ops: what a model file builds its graph from.

Layouts: activations are ``[T, features]`` (T tokens of the step, all sequences packed); attention
heads are ``[T, heads, head_dim]``; the KV pool of one layer is ``[NS, kv_heads, head_dim]`` (NS
slots; slot = page * page_size + offset). Sequences in the step are described by ``q_start``,
``q_len`` and ``kv_len`` (each ``[B]``) and a page table ``[B, P]``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .ops import AttrSpec, OpDef, expect, expect_int, expect_rank, expect_same, register_op
from .types import DType, TensorType, same_dim
from .weights import ACT_QUANT, QuantizedType

Types = Sequence[TensorType]
Attrs = Mapping[str, Any]


def _embedding(t: Types, a: Attrs) -> tuple[TensorType, ...]:
    ids, table = t[:2]
    expect_int("embedding", "ids", ids)
    expect_rank("embedding", "ids", ids, 1)
    expect_rank("embedding", "table", table, 2)
    if len(t) == 3:
        row_start = t[2]
        expect_int("embedding", "row_start", row_start)
        expect(row_start.shape == (1,), f"embedding: row_start must be one index ([1]), got {row_start}")
    return (TensorType((ids.shape[0], table.shape[1]), table.dtype),)


def infer_rmsnorm(t: Types, a: Attrs) -> tuple[TensorType, ...]:
    x, w = t
    expect_rank("rmsnorm", "weight", w, 1)
    expect(x.rank >= 1 and same_dim(x.shape[-1], w.shape[0]), f"rmsnorm: weight {w} does not match last dim of {x}")
    return (x,)


def _elementwise_binary(name: str):
    def infer(t: Types, a: Attrs) -> tuple[TensorType, ...]:
        expect_same(name, t[0], t[1])
        return (t[0],)

    return infer


def _unary(t: Types, a: Attrs) -> tuple[TensorType, ...]:
    return (t[0],)


def infer_linear(t: Types, a: Attrs) -> tuple[TensorType, ...]:
    """A quantized weight is read as the weight its format encodes (its logical shape, in x's dtype);
    a plain one must have x's dtype. ``act_quant`` (per-token activation quantization) goes with a
    quantized weight only."""
    x, w = t[0], t[1]
    expect_rank("linear", "x", x, 2)
    expect_rank("linear", "weight", w, 2)
    out_features, in_features = w.logical_shape if isinstance(w, QuantizedType) else w.shape
    expect(same_dim(x.shape[1], in_features), f"linear: x {x} and weight {w} disagree on in-features")
    expect(isinstance(w, QuantizedType) or x.dtype == w.dtype,
           f"linear: x {x} and weight {w} differ in dtype (a weight stored in another dtype needs a quantized format)")
    act_quant = a.get("act_quant")
    expect(act_quant is None or (act_quant in ACT_QUANT and isinstance(w, QuantizedType)),
           f"linear: act_quant={act_quant!r} needs a quantized weight and one of {', '.join(ACT_QUANT)}")
    if len(t) == 3:
        bias = t[2]
        expect(bias.rank == 1 and same_dim(bias.shape[0], out_features),
               f"linear: bias {bias} does not match weight {w}")
    return (TensorType((x.shape[0], out_features), x.dtype),)


def _reshape(t: Types, a: Attrs) -> tuple[TensorType, ...]:
    x = t[0]
    shape = tuple(a["shape"])
    # Symbolic dims must be carried over, and the static part of the element count must agree.
    expect(x.symbols() == {d for d in shape if isinstance(d, str)}, f"reshape: symbols of {x} and {list(shape)} differ")
    static_in = _static_count(x.shape)
    static_out = _static_count(shape)
    expect(static_in == static_out, f"reshape: cannot view {x} as {list(shape)}")
    return (TensorType(shape, x.dtype),)


def _static_count(shape: Sequence) -> int:
    count = 1
    for d in shape:
        if isinstance(d, int):
            count *= d
    return count


def _split(t: Types, a: Attrs) -> tuple[TensorType, ...]:
    x = t[0]
    sizes = a["sizes"]
    last = x.shape[-1]
    expect(isinstance(last, int) and sum(sizes) == last, f"split: sizes {list(sizes)} do not sum to last dim of {x}")
    return tuple(TensorType(x.shape[:-1] + (s,), x.dtype) for s in sizes)


def infer_rope(t: Types, a: Attrs) -> tuple[TensorType, ...]:
    x, positions, cos_sin = t
    expect_rank("rope", "x", x, 3)
    expect_int("rope", "positions", positions)
    expect(same_dim(positions.shape[0], x.shape[0]), f"rope: positions {positions} do not match x {x}")
    expect_rank("rope", "cos_sin", cos_sin, 2)
    expect(cos_sin.dtype == DType.f32, f"rope: cos_sin table must be f32, got {cos_sin}")
    rot = cos_sin.shape[1]
    expect(isinstance(rot, int) and rot % 2 == 0 and rot <= x.shape[2], f"rope: table {cos_sin} does not fit head dim of {x}")
    return (x,)


def infer_kv_store(t: Types, a: Attrs) -> tuple[TensorType, ...]:
    k_cache, v_cache, k, v, slots = t
    for name, cache, new in (("k", k_cache, k), ("v", v_cache, v)):
        expect_rank("kv_store", f"{name}_cache", cache, 3)
        expect_rank("kv_store", name, new, 3)
        expect(cache.shape[1:] == new.shape[1:] and cache.dtype in (new.dtype, DType.f8e4m3),
               f"kv_store: {name} {new} does not fit cache {cache}")
    expect_int("kv_store", "slots", slots)
    expect(same_dim(slots.shape[0], k.shape[0]), f"kv_store: slots {slots} do not match k {k}")
    return (k_cache, v_cache)


def infer_paged_attention(t: Types, a: Attrs) -> tuple[TensorType, ...]:
    q, k_cache, v_cache, q_start, q_len, kv_len, page_table = t[:7]
    for tree_mask in t[7:]:
        expect_int("paged_attention", "tree_mask", tree_mask)
        expect_rank("paged_attention", "tree_mask", tree_mask, 1)
        expect(same_dim(tree_mask.shape[0], q.shape[0]), f"paged_attention: tree_mask {tree_mask} does not match q {q}")
    expect_rank("paged_attention", "q", q, 3)
    expect_rank("paged_attention", "k_cache", k_cache, 3)
    expect_same("paged_attention", k_cache, v_cache)
    expect(same_dim(q.shape[2], k_cache.shape[2]), f"paged_attention: head dim of q {q} and cache {k_cache} differ")
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    expect(isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads == 0,
           f"paged_attention: {heads} query heads cannot share {kv_heads} kv heads")
    for name, s in (("q_start", q_start), ("q_len", q_len), ("kv_len", kv_len)):
        expect_int("paged_attention", name, s)
        expect_rank("paged_attention", name, s, 1)
        expect(same_dim(s.shape[0], q_start.shape[0]), f"paged_attention: {name} {s} has a different batch size")
    expect_rank("paged_attention", "page_table", page_table, 2)
    expect(same_dim(page_table.shape[0], q_start.shape[0]), f"paged_attention: page_table {page_table} has a different batch size")
    expect(a["page_size"] >= 1, "paged_attention: page_size must be >= 1")
    return (q,)


def _gather_rows(t: Types, a: Attrs) -> tuple[TensorType, ...]:
    x, index = t
    expect_rank("gather_rows", "x", x, 2)
    expect_int("gather_rows", "index", index)
    expect_rank("gather_rows", "index", index, 1)
    return (TensorType((index.shape[0], x.shape[1]), x.dtype),)


def _cast(t: Types, a: Attrs) -> tuple[TensorType, ...]:
    return (t[0].with_dtype(DType(a["dtype"])),)


def _concat(t: Types, a: Attrs) -> tuple[TensorType, ...]:
    first = t[0]
    expect_rank("concat", "a", first, 2)
    width = 0
    for name, x in zip("abc", t):
        expect(x.rank == 2 and same_dim(x.shape[0], first.shape[0]) and x.dtype == first.dtype,
               f"concat: {name} {x} does not match a {first} in rows and dtype")
        expect(isinstance(x.shape[1], int), f"concat: {name} {x} needs a static width")
        width += x.shape[1]
    return (TensorType((first.shape[0], width), first.dtype),)


def _argmax(t: Types, a: Attrs) -> tuple[TensorType, ...]:
    expect_rank("argmax", "x", t[0], 2)
    return (TensorType((t[0].shape[0],), DType.i32),)


register_op(OpDef("embedding", ("ids", "table", "row_start?"), {}, _embedding,
                  doc="rows of table picked by ids; with row_start, the table holds the vocabulary's rows from "
                      "row_start on (one rank's shard) and ids outside it give zero rows"))
register_op(OpDef("rmsnorm", ("x", "weight"), {"eps": AttrSpec("float")}, infer_rmsnorm,
                  doc="weight * (x / rms(x)) over the last dim; the normalization in f32, the scaling in x's dtype"))
register_op(OpDef("add", ("a", "b"), {}, _elementwise_binary("add")))
register_op(OpDef("mul", ("a", "b"), {}, _elementwise_binary("mul")))
register_op(OpDef("silu", ("x",), {}, _unary))
# The linear family's attribute: how it treats activations beside a quantized weight (unset: as they are).
LINEAR_ATTRS = {"act_quant": AttrSpec("str", None)}
register_op(OpDef("linear", ("x", "weight", "bias?"), LINEAR_ATTRS, infer_linear, quantized=("weight",),
                  doc="x @ weight.T (+ bias)"))
register_op(OpDef("reshape", ("x",), {"shape": AttrSpec("dims")}, _reshape, aliases=(0,), doc="a view with another shape"))
register_op(OpDef("split", ("x",), {"sizes": AttrSpec("ints")}, _split, num_outputs=None, aliases=(0,),
                  doc="views of consecutive column ranges of the last dim"))
register_op(OpDef("rope", ("x", "positions", "cos_sin"), {}, infer_rope,
                  doc="rotary embedding, half-split (neox) layout, on the first cos_sin.shape[1] dims of each head"))
# An FP8 KV cache's scales (set by the quantize_kv_cache pass; unset: the pool holds k and v as they
# are): the pool stores k / k_scale and v / v_scale in f8e4m3, and attention reads them back times the scale.
KV_SCALE_ATTRS = {"k_scale": AttrSpec("float", None), "v_scale": AttrSpec("float", None)}
register_op(OpDef("kv_store", ("k_cache", "v_cache", "k", "v", "slots"), KV_SCALE_ATTRS, infer_kv_store, num_outputs=2,
                  aliases=(0, 1), has_effect=True,
                  doc="writes k and v of each token into its slot of the pool; returns the updated pool"))
register_op(OpDef(
    "paged_attention",
    ("q", "k_cache", "v_cache", "q_start", "q_len", "kv_len", "page_table", "tree_mask?"),
    {"scale": AttrSpec("float"), "page_size": AttrSpec("int"), "sliding_window": AttrSpec("int", 0),
     "soft_cap": AttrSpec("float", 0.0), **KV_SCALE_ATTRS},
    infer_paged_attention,
    doc="causal attention of each sequence's new tokens over its whole context in the paged pool (GQA); "
        "tree_mask (i32 per token): a draft tree's ancestors among the context's last 32 keys (kernels/attention.py)",
))
register_op(OpDef("gather_rows", ("x", "index"), {}, _gather_rows, doc="x[index]"))
register_op(OpDef("cast", ("x",), {"dtype": AttrSpec("dtype")}, _cast))
register_op(OpDef("concat", ("a", "b", "c?"), {}, _concat, doc="the rows of a, b (and c) side by side: [rows, a + b (+ c)]"))
register_op(OpDef("argmax", ("x",), {}, _argmax, doc="each row's index of its largest value (ties: the lowest), i32"))
