"""Before/Expected IR tests of fuse_rope_attention: rope + KV store joining the attention reading it."""

from kiln.compiler.passes.fuse_rope_attention import fuse_rope_attention

from .test_fuse_rope_kv_store import ATTENTION, HEADER
from .ir_text import dedent, run_pass

STORE = ("      %qr, %kc2, %vc2 = rope_kv_store(%q, %k, %v, %positions, @cos_sin, %kc, %vc, %slots) {eps=0.0} "
         ": f32[T, 4, 8], f32[NS, 2, 8], f32[NS, 2, 8]\n")


def run(text: str) -> str:
    return run_pass(fuse_rope_attention, dedent(text))


def test_store_joins_the_attention():
    before = HEADER + STORE + ATTENTION
    expected = HEADER + """      %a, %kc2, %vc2 = rope_kv_attention(%q, %k, %v, %positions, @cos_sin, %kc, %vc, %slots, %q_start, %q_len, %kv_len, %page_table) {page_size=4, scale=0.35, sliding_window=0, soft_cap=0.0} : f32[T, 4, 8], f32[NS, 2, 8], f32[NS, 2, 8]
      return %a
    }
"""
    assert run(before) == dedent(expected)


def test_rotated_q_read_elsewhere_blocks_the_fusion():
    before = HEADER + STORE + ATTENTION.replace("return %a", "return %a, %qr")
    assert run(before) == dedent(before)


def test_cache_read_between_store_and_attention_blocks_the_fusion():
    # The fused node would take the attention's place, after a reader of the store's output.
    reader = "      %kr = reshape(%kc2) {shape=[\"NS\", 16]} : f32[NS, 16]\n"
    before = HEADER + STORE + reader + ATTENTION.replace("return %a", "return %a, %kr")
    assert run(before) == dedent(before)


def test_qk_normed_store_keeps_its_own_kernel():
    header = HEADER.replace("      param @cos_sin: f32[64, 8]\n", "      param @cos_sin: f32[64, 8]\n"
                            "      param @qn: f32[8]\n      param @kn: f32[8]\n")
    normed = STORE.replace("%slots) {eps=0.0}", "%slots, @qn, @kn) {eps=1e-06}")
    before = header + normed + ATTENTION
    assert run(before) == dedent(before)
