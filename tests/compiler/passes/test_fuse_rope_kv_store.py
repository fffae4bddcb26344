"""Before/Expected IR tests of fuse_rope_kv_store, with and without Qwen3's q/k norm."""

import textwrap

from kiln.compiler.passes.fuse_rope_kv_store import fuse_rope_kv_store

from .ir_text import run_pass

HEADER = """
    graph g {
      input %q: f32[T, 4, 8]
      input %k: f32[T, 2, 8]
      input %v: f32[T, 2, 8]
      input %positions: i32[T]
      input %slots: i32[T]
      input %kc: f32[NS, 2, 8]
      input %vc: f32[NS, 2, 8]
      input %q_start: i32[B]
      input %q_len: i32[B]
      input %kv_len: i32[B]
      input %page_table: i32[B, P]
      param @cos_sin: f32[64, 8]
"""
ATTENTION = """      %a = paged_attention(%qr, %kc2, %vc2, %q_start, %q_len, %kv_len, %page_table) {page_size=4, scale=0.35, sliding_window=0, soft_cap=0.0} : f32[T, 4, 8]
      return %a
    }
"""

def run(text: str) -> str:
    return run_pass(fuse_rope_kv_store, text)


def test_rope_and_store_fuse():
    before = HEADER + """      %qr = rope(%q, %positions, @cos_sin) : f32[T, 4, 8]
      %kr = rope(%k, %positions, @cos_sin) : f32[T, 2, 8]
      %kc2, %vc2 = kv_store(%kc, %vc, %kr, %v, %slots) : f32[NS, 2, 8], f32[NS, 2, 8]
""" + ATTENTION
    expected = HEADER + """      %qr, %kc2, %vc2 = rope_kv_store(%q, %k, %v, %positions, @cos_sin, %kc, %vc, %slots) {eps=0.0} : f32[T, 4, 8], f32[NS, 2, 8], f32[NS, 2, 8]
""" + ATTENTION
    assert run(before) == textwrap.dedent(expected).lstrip("\n")


def test_qk_norm_folds_in():
    header = HEADER.replace("      param @cos_sin: f32[64, 8]\n", "      param @cos_sin: f32[64, 8]\n"
                            "      param @qn: f32[8]\n      param @kn: f32[8]\n")
    before = header + """      %qn2 = rmsnorm(%q, @qn) {eps=1e-06} : f32[T, 4, 8]
      %kn2 = rmsnorm(%k, @kn) {eps=1e-06} : f32[T, 2, 8]
      %qr = rope(%qn2, %positions, @cos_sin) : f32[T, 4, 8]
      %kr = rope(%kn2, %positions, @cos_sin) : f32[T, 2, 8]
      %kc2, %vc2 = kv_store(%kc, %vc, %kr, %v, %slots) : f32[NS, 2, 8], f32[NS, 2, 8]
""" + ATTENTION
    expected = header + """      %qr, %kc2, %vc2 = rope_kv_store(%q, %k, %v, %positions, @cos_sin, %kc, %vc, %slots, @qn, @kn) {eps=1e-06} : f32[T, 4, 8], f32[NS, 2, 8], f32[NS, 2, 8]
""" + ATTENTION
    assert run(before) == textwrap.dedent(expected).lstrip("\n")


def test_rotated_k_read_elsewhere_blocks_the_fusion():
    before = HEADER + """      %qr = rope(%q, %positions, @cos_sin) : f32[T, 4, 8]
      %kr = rope(%k, %positions, @cos_sin) : f32[T, 2, 8]
      %kc2, %vc2 = kv_store(%kc, %vc, %kr, %v, %slots) : f32[NS, 2, 8], f32[NS, 2, 8]
""" + ATTENTION.replace("return %a", "return %a, %kr")
    assert run(before) == textwrap.dedent(before).lstrip("\n")
