"""concat and argmax: the registered kernels against their references, at odd sizes."""

import pytest
import torch

from kiln.kernels import get_impl
from kiln.kernels.rows import ref_argmax, ref_concat


@pytest.mark.parametrize("rows,widths", [(1, (3, 5)), (7, (4, 4, 9)), (0, (2, 3))])
def test_concat(rows, widths):
    parts = [torch.randn(rows, w) for w in widths]
    out = torch.empty(rows, sum(widths))
    get_impl("torch.concat").fn(*parts, out=out)
    torch.testing.assert_close(out, ref_concat(*parts), rtol=0, atol=0)
    assert torch.equal(out[:, :widths[0]], parts[0])


@pytest.mark.parametrize("rows,vocab", [(1, 7), (5, 33), (3, 1000)])
def test_argmax_first_maximum(rows, vocab):
    x = torch.randn(rows, vocab)
    x[0, vocab // 2] = x[0, vocab - 1] = 100.0  # a tie: the lower index wins
    out = torch.empty(rows, dtype=torch.int32)
    get_impl("torch.argmax").fn(x, out=out)
    assert torch.equal(out, ref_argmax(x))
    assert out[0] == vocab // 2 or vocab // 2 == vocab - 1
