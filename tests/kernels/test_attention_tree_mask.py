"""Paged attention with a draft tree's mask: the reference against attention over each node's own
path (its prefix and ancestors, as plain causal attention sees them), and the Triton extend kernel
(and the dispatcher) against the reference at several shapes, under the interpreter on the CPU."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.attention import ref_paged_attention, triton_paged_attention
from kiln.kernels.attention_block import TREE_WINDOW_KEYS
from kiln.kernels.attention_extend import launch_extend
from tests.kernels.test_attention import attrs, check_rows, make_batch


def random_tree_masks(q_lens: list[int], kv_lens: list[int], trees: list[bool]) -> tuple[torch.Tensor, list]:
    """Per sequence, a random tree over its new tokens (node i's parent before it, or none: the
    prefix), as the i32 rows the op takes (-1 for a sequence that is not a tree), with the parents."""
    rows, parents = [], []
    for n, length, tree in zip(q_lens, kv_lens, trees):
        if not tree:
            rows.extend([-1] * n)
            parents.append(None)
            continue
        parent = [-1] + [int(torch.randint(-1, i, ()).item()) for i in range(1, n)]
        parents.append(parent)
        start, window = length - n, length - TREE_WINDOW_KEYS
        for i in range(n):
            visible = set(range(start))
            node = i
            while node >= 0:
                visible.add(start + node)
                node = parent[node]
            bits = sum(1 << (k - window) for k in visible if k >= window)
            rows.append(bits - (1 << 32) if bits >= 1 << 31 else bits)  # as an i32
    return torch.tensor(rows, dtype=torch.int32), parents


def test_reference_is_attention_over_each_nodes_path():
    q_lens, kv_lens = [6, 9], [20, 9]
    batch = make_batch(q_lens, kv_lens, 4, 2, 16, 4, torch.float32, "cpu")
    mask, parents = random_tree_masks(q_lens, kv_lens, [True, True])
    got = ref_paged_attention(*batch.inputs(), mask, **attrs(16, 4))
    for b, (n, length) in enumerate(zip(q_lens, kv_lens)):
        start = length - n
        for i in range(n):
            path, node = [], i
            while node >= 0:
                path.insert(0, start + node)
                node = parents[b][node]
            context = list(range(start)) + path  # the keys node i sees, itself last
            pages = batch.page_table[b]
            slots = [int(pages[k // 4]) * 4 + k % 4 for k in context]
            row = int(batch.q_start[b]) + i
            k = batch.k_cache[slots].repeat_interleave(2, dim=1)
            v = batch.v_cache[slots].repeat_interleave(2, dim=1)
            probs = (torch.einsum("hd,lhd->hl", batch.q[row], k) * 16 ** -0.5).softmax(-1)
            torch.testing.assert_close(got[row], torch.einsum("hl,lhd->hd", probs, v), rtol=1e-5, atol=1e-5)


# (q_lens, kv_lens, which sequences are trees, heads, kv_heads, head_dim, page_size): trees shorter
# than the window's context and longer, a plain prefill chunk and single tokens beside them, GQA.
CASES = [
    ([5, 1, 12], [40, 7, 12], [True, False, True], 4, 2, 64, 4),
    ([17, 30], [17, 100], [False, True], 6, 3, 32, 16),
    ([32, 3, 8], [70, 3, 33], [True, True, True], 4, 4, 64, 1),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_extend_kernel_with_a_tree_mask(case, dtype, device, poisoned, assert_matches):
    q_lens, kv_lens, trees, heads, kv_heads, head_dim, page_size = case
    batch = make_batch(q_lens, kv_lens, heads, kv_heads, head_dim, page_size, dtype, device, gap=1)
    mask, _ = random_tree_masks(q_lens, kv_lens, trees)
    rows = torch.full((batch.q.shape[0],), -1, dtype=torch.int32)
    rows[batch.owned.cpu()] = mask
    rows = rows.to(device)
    out = poisoned(tuple(batch.q.shape), dtype)
    launch_extend(*batch.inputs(), out, max_q_len=max(q_lens), block_m=16, block_n=16, num_warps=4,
                  tree_mask=rows, **attrs(head_dim, page_size))
    want = ref_paged_attention(*batch.inputs(), rows, **attrs(head_dim, page_size))
    check_rows(out, batch, want, assert_matches)
    # The mask matters: without it the tree rows differ.
    assert not torch.allclose(want, ref_paged_attention(*batch.inputs(), **attrs(head_dim, page_size)))


def test_dispatch_with_a_tree_mask(device, poisoned, assert_matches):
    q_lens, kv_lens = [4, 7], [25, 7]
    batch = make_batch(q_lens, kv_lens, 4, 2, 64, 4, torch.float32, device)
    mask, _ = random_tree_masks(q_lens, kv_lens, [True, True])
    out = poisoned(tuple(batch.q.shape), torch.float32)
    triton_paged_attention(*batch.inputs(), mask.to(device), out=out, sizes={"max_q_len": 7}, **attrs(64, 4))
    check_rows(out, batch, ref_paged_attention(*batch.inputs(), mask.to(device), **attrs(64, 4)), assert_matches)
    with pytest.raises(ValueError, match=r"tree_mask must be i32 \[11\]"):
        triton_paged_attention(*batch.inputs(), mask[:3].to(device), out=out, **attrs(64, 4))
