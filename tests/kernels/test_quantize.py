"""The block 8-bit schemes' reference encoders (kiln.kernels.quantize): fp8_block128 and int8_block32
scale each block of a row by its own largest magnitude, read back as written out here by hand, and hold
exactly the weights they can represent."""

from __future__ import annotations

import pytest
import torch

from kiln.ir.weights import SCHEMES
from kiln.kernels.quantize import dequantize, quantize

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
# scheme -> (block, largest code, storage dtype)
BLOCKS = {"fp8_block128": (128, FP8_MAX, torch.float8_e4m3fn), "int8_block32": (32, 127.0, torch.int8)}


@pytest.mark.parametrize("scheme", list(BLOCKS))
def test_each_block_has_its_own_scale(scheme):
    block, limit, dtype = BLOCKS[scheme]
    torch.manual_seed(0)
    w = torch.randn(5, 3 * block) * torch.tensor([0.01, 1.0, 100.0]).repeat_interleave(block)
    stored, (scale,) = quantize(w, SCHEMES[scheme])
    assert stored.dtype == dtype and scale.shape == (5, 3) and scale.dtype == torch.float32
    expected_scale = w.reshape(5, 3, block).abs().amax(dim=-1) / limit
    assert torch.equal(scale, expected_scale)
    by_hand = stored.float().reshape(5, 3, block) * scale[..., None]
    assert torch.equal(dequantize(stored, (scale,), SCHEMES[scheme]), by_hand.reshape(5, -1))
    assert ((by_hand.reshape(5, -1) - w).abs() <= scale.repeat_interleave(block, 1) * limit / 8).all()


@pytest.mark.parametrize("scheme", list(BLOCKS))
def test_representable_weights_round_trip_exactly(scheme):
    block, limit, dtype = BLOCKS[scheme]
    g = torch.Generator().manual_seed(1)
    codes = (torch.randn(7, 2 * block, generator=g) * limit / 3).clamp(-limit, limit).to(dtype).float()
    codes[:, ::block] = limit  # each block's largest magnitude is the code limit: its scale is its factor
    w = codes * 2.0 ** torch.randint(-6, 3, (7, 2), generator=g).float().repeat_interleave(block, 1)
    stored, scales = quantize(w, SCHEMES[scheme])
    assert torch.equal(dequantize(stored, scales, SCHEMES[scheme]), w)
