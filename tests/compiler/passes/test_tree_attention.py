"""Before/Expected IR tests of tree_attention, and the fused attention keeping the mask."""

from kiln.compiler.passes.base import PassContext
from kiln.compiler.passes.fuse_rope_attention import fuse_rope_attention
from kiln.compiler.passes.tree_attention import tree_attention
from kiln.ir import parse_graph, print_graph

from .ir_text import dedent, run_pass


GRAPH = """
    graph g {{
      input %q: f32[T, 2, 8]
      input %k: f32[T, 1, 8]
      input %v: f32[T, 1, 8]
      input %positions: i32[T]
      input %slots: i32[T]
      input %q_start: i32[B]
      input %q_len: i32[B]
      input %kv_len: i32[B]
      input %page_table: i32[B, P]
{mask_input}      input %k_cache.0: f32[64, 1, 8]
      input %v_cache.0: f32[64, 1, 8]
      param @cos_sin: f32[32, 8]
      %qr, %kc, %vc = rope_kv_store(%q, %k, %v, %positions, @cos_sin, %k_cache.0, %v_cache.0, %slots) {{eps=0.0}} : f32[T, 2, 8], f32[64, 1, 8], f32[64, 1, 8]
      %a = paged_attention(%qr, %kc, %vc, %q_start, %q_len, %kv_len, %page_table{mask}) {{page_size=4, scale=0.5, sliding_window=0, soft_cap=0.0}} : f32[T, 2, 8]
      return %a
    }}
"""
MASK_INPUT = "      input %tree_mask: i32[T]\n"


def graph_text(mask_input: str = "", mask: str = "") -> str:
    return dedent(GRAPH.format(mask_input=mask_input, mask=mask))


def run(text: str) -> str:
    return run_pass(tree_attention, text)


def test_attention_reads_the_tree_mask_input():
    assert run(graph_text(MASK_INPUT)) == graph_text(MASK_INPUT, ", %tree_mask")


def test_a_graph_without_the_input_is_left_alone():
    assert run(graph_text()) == graph_text()


def test_the_fused_attention_keeps_the_mask():
    graph = parse_graph(graph_text(MASK_INPUT, ", %tree_mask"))
    fused = print_graph(fuse_rope_attention(graph, PassContext()))
    assert ("%a, %kc, %vc = rope_kv_attention(%q, %k, %v, %positions, @cos_sin, %k_cache.0, %v_cache.0, %slots, "
            "%q_start, %q_len, %kv_len, %page_table, %tree_mask)") in fused
