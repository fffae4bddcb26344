"""Before/Expected IR tests of quantize_kv_cache: the pool inputs become f8e4m3 and the ops storing
into and reading each layer's pool carry its scales (1.0, or the calibrated ones given per layer);
an unquantized cache leaves the graph as it is."""

import textwrap

import pytest

from kiln.compiler.passes.base import PassContext
from kiln.compiler.passes.quantize_kv_cache import quantize_kv_cache

from .ir_text import run_pass

HEADER = """
    graph g {{
      input %q: bf16[T, 4, 8]
      input %k: bf16[T, 2, 8]
      input %v: bf16[T, 2, 8]
      input %positions: i32[T]
      input %slots: i32[T]
      input %kc0: {dtype}[NS, 2, 8]
      input %vc0: {dtype}[NS, 2, 8]
      input %kc1: {dtype}[NS, 2, 8]
      input %vc1: {dtype}[NS, 2, 8]
      input %q_start: i32[B]
      input %q_len: i32[B]
      input %kv_len: i32[B]
      input %page_table: i32[B, P]
      param @cos_sin: f32[64, 8]
"""
# Layer 0 unfused (store, then attention), layer 1 the fused rope + store + attention.
BODY = """      %kc0s, %vc0s = kv_store(%kc0, %vc0, %k, %v, %slots){s0} : {dtype}[NS, 2, 8], {dtype}[NS, 2, 8]
      %a0 = paged_attention(%q, %kc0s, %vc0s, %q_start, %q_len, %kv_len, %page_table) {{{k0}page_size=4, scale=0.35, sliding_window=0, soft_cap=0.0{v0}}} : bf16[T, 4, 8]
      %a1, %kc1s, %vc1s = rope_kv_attention(%a0, %k, %v, %positions, @cos_sin, %kc1, %vc1, %slots, %q_start, %q_len, %kv_len, %page_table) {{{k1}page_size=4, scale=0.35, sliding_window=0, soft_cap=0.0{v1}}} : bf16[T, 4, 8], {dtype}[NS, 2, 8], {dtype}[NS, 2, 8]
      return %a1
    }}
"""

def graph_text(dtype: str, scales: list[tuple[float, float]] | None) -> str:
    """The graph with its pool in ``dtype`` and, given ``scales``, each layer's on its ops (attributes
    print in name order: k_scale first, v_scale last)."""
    k = ["" if scales is None else f"k_scale={k}, " for k, _ in (scales or [(0, 0)] * 2)]
    v = ["" if scales is None else f", v_scale={v}" for _, v in (scales or [(0, 0)] * 2)]
    s0 = "" if scales is None else f" {{k_scale={scales[0][0]}, v_scale={scales[0][1]}}}"
    text = (HEADER + BODY).format(dtype=dtype, s0=s0, k0=k[0], v0=v[0], k1=k[1], v1=v[1])
    return textwrap.dedent(text).lstrip("\n")


def run(text: str, **ctx) -> str:
    return run_pass(quantize_kv_cache, text, PassContext(**ctx))


def test_the_pool_becomes_fp8_with_unit_scales():
    before = graph_text("bf16", None)
    assert run(before, kv_cache_dtype="fp8_e4m3") == graph_text("f8e4m3", [(1.0, 1.0), (1.0, 1.0)])


def test_calibrated_scales_go_to_their_layers():
    before = graph_text("bf16", None)
    scales = ((0.5, 0.25), (2.0, 0.125))
    assert run(before, kv_cache_dtype="fp8_e4m3", kv_cache_scales=scales) == graph_text("f8e4m3", list(scales))


def test_auto_leaves_the_graph_alone():
    before = graph_text("bf16", None)
    assert run(before) == before


def test_a_scale_per_layer_is_required():
    with pytest.raises(ValueError, match=r"kv_cache_scales has 1 \(k, v\) pairs; the model has 2 layers"):
        run(graph_text("bf16", None), kv_cache_dtype="fp8_e4m3", kv_cache_scales=((1.0, 1.0),))
