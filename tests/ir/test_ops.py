"""The op registry's definitions: finding a node's input by the name its op declares."""

from __future__ import annotations

import pytest

from kiln.ir import get_op


def test_input_named_finds_required_and_optional_inputs_and_none_for_one_left_out():
    attention = get_op("paged_attention")
    causal = ("%q", "%kc", "%vc", "%qs", "%ql", "%kl", "%pt")
    assert attention.input_named(causal, "kv_len") == "%kl"
    assert attention.input_named(causal, "tree_mask") is None
    assert attention.input_named((*causal, "%mask"), "tree_mask") == "%mask"
    with pytest.raises(ValueError):
        attention.input_named(causal, "q_norm")  # no such input of this op
