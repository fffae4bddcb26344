"""Applying token bitmasks: the torch implementation against xgrammar's reference, and the Triton
kernel (under TRITON_INTERPRET=1 on CPU, compiled on a GPU) against the torch one."""

from __future__ import annotations

import math

import pytest
import torch
import xgrammar

from kiln.kernels import KernelConfig, impl_for_device
from kiln.kernels.bitmask import (allocate_bitmask, bitmask_width, ref_apply_bitmask, triton_apply_bitmask,
                                  unpack_bitmask)
from kiln.kernels.triton_support import INTERPRET

VOCAB_SIZES = [1, 31, 32, 33, 1000, 4131, 49172]
KERNEL_DEVICE = "cpu" if INTERPRET else "cuda"


def random_case(batch: int, vocab_size: int, seed: int, dtype=torch.float32, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab_size, generator=generator).to(dtype)
    bitmask = torch.randint(-2**31, 2**31, (batch, bitmask_width(vocab_size)), generator=generator,
                            dtype=torch.int64).to(torch.int32)
    bitmask[0] = -1  # one row allowing everything
    return logits.to(device), bitmask.to(device)


def expected(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None) -> torch.Tensor:
    """Bit by bit, in plain Python-level indexing: the definition of the layout."""
    result = logits.clone()
    for row in range(logits.shape[0]) if rows is None else [r for r in rows if r >= 0]:
        for token in range(logits.shape[1]):
            if not (int(bitmask[row, token // 32]) >> (token % 32)) & 1:
                result[row, token] = -math.inf
    return result


def test_allocate_and_unpack():
    bitmask = allocate_bitmask(3, 70)
    assert bitmask.shape == (3, 3) and bitmask.dtype == torch.int32 and bool((bitmask == -1).all())
    assert bool(unpack_bitmask(bitmask, 70).all()) and unpack_bitmask(bitmask, 70).shape == (3, 70)
    # Row 1 allows tokens 0 and 2 (word 0), none of 32..63, and 64 and 95 (word 2; 95 is past the width).
    bitmask[1] = torch.tensor([0b101, 0, -2**31 | 1], dtype=torch.int32)
    assert unpack_bitmask(bitmask, 70)[1].nonzero().flatten().tolist() == [0, 2, 64]


@pytest.mark.parametrize("vocab_size", [31, 33, 1000])
def test_torch_matches_the_bitwise_definition(vocab_size):
    logits, bitmask = random_case(3, vocab_size, seed=vocab_size)
    for rows in (None, [2], [1, -1, 2]):
        got = logits.clone()
        ref_apply_bitmask(got, bitmask, None if rows is None else torch.tensor(rows))
        assert torch.equal(got, expected(logits, bitmask, rows))


@pytest.mark.parametrize("vocab_size", VOCAB_SIZES)
def test_torch_matches_xgrammar(vocab_size):
    logits, bitmask = random_case(5, vocab_size, seed=vocab_size)
    ours, theirs = logits.clone(), logits.clone()
    ref_apply_bitmask(ours, bitmask)
    xgrammar.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab_size)
    assert torch.equal(ours, theirs)
    rows = [4, 1, 3]
    ours, theirs = logits.clone(), logits.clone()
    ref_apply_bitmask(ours, bitmask, torch.tensor(rows))
    xgrammar.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab_size, indices=rows)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[[0, 2]], logits[[0, 2]])  # rows not listed are untouched


# Every vocabulary in every dtype, one and many programs a row; but SmolLM2's whole vocabulary with two
# words a program (hundreds of programs a row) takes ~19 s a dtype under the interpreter, so it runs in
# bf16 only: the dtypes' loads and stores are the same code at every smaller vocabulary.
KERNEL_CASES = [(vocab_size, dtype, words) for words in (32, 2) for vocab_size in VOCAB_SIZES
                for dtype in (torch.float32, torch.bfloat16, torch.float16)
                if not (words == 2 and vocab_size == VOCAB_SIZES[-1] and dtype != torch.bfloat16)]


@pytest.mark.parametrize("vocab_size, dtype, words_per_program", KERNEL_CASES)
def test_triton_kernel_matches_torch(vocab_size, dtype, words_per_program):
    logits, bitmask = random_case(4, vocab_size, seed=vocab_size + 1, dtype=dtype)
    config = KernelConfig(bitmask_words_per_program=words_per_program)
    for rows in (None, [3, 0], [2, -1, -1, 1]):
        ours, reference = logits.clone().to(KERNEL_DEVICE), logits.clone()
        row_tensor = None if rows is None else torch.tensor(rows, dtype=torch.int32)
        triton_apply_bitmask(ours, bitmask.to(KERNEL_DEVICE), None if rows is None else row_tensor.to(KERNEL_DEVICE),
                             config=config)
        ref_apply_bitmask(reference, bitmask, row_tensor)
        assert torch.equal(ours.cpu(), reference), f"rows={rows}"


def test_triton_kernel_honours_row_strides():
    # Logits as a view with a wider row stride (a slice of a bigger buffer) are masked in place.
    buffer, bitmask = random_case(3, 96, seed=3)
    logits = buffer[:, :70].to(KERNEL_DEVICE)
    narrow_mask = bitmask[:, :bitmask_width(70)].contiguous()
    reference = logits.cpu().clone()
    ref_apply_bitmask(reference, narrow_mask)
    triton_apply_bitmask(logits, narrow_mask.to(KERNEL_DEVICE))
    assert torch.equal(logits.cpu(), reference)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """The registry's ``apply_bitmask`` for the logits' device, as the sampler calls it."""
    impl_for_device("apply_bitmask", logits.device).fn(logits, bitmask, rows)


def test_apply_bitmask_dispatches_by_device():
    logits, bitmask = random_case(2, 100, seed=5)
    assert impl_for_device("apply_bitmask", logits.device).fn is ref_apply_bitmask
    assert impl_for_device("apply_bitmask", torch.device("cuda")).fn is triton_apply_bitmask
    ours, reference = logits.clone(), logits.clone()
    apply_bitmask(ours, bitmask, torch.tensor([1]))
    ref_apply_bitmask(reference, bitmask, torch.tensor([1]))
    assert torch.equal(ours, reference)


def test_inputs_are_checked():
    logits, bitmask = random_case(2, 100, seed=6)
    with pytest.raises(ValueError, match="need 4"):
        apply_bitmask(logits, bitmask[:, :3].contiguous())
    with pytest.raises(ValueError, match="pass rows to mask a subset"):
        apply_bitmask(logits, bitmask[:1])
    with pytest.raises(ValueError, match="bitmask must be int32"):
        apply_bitmask(logits, bitmask.to(torch.int64))
    with pytest.raises(ValueError, match="index past"):
        apply_bitmask(logits, bitmask, torch.tensor([2]))
    with pytest.raises(ValueError, match="rows must be int32 or int64"):
        apply_bitmask(logits, bitmask, torch.tensor([0.0]))


@pytest.mark.gpu
def test_cuda_logits_use_the_kernel():
    logits, bitmask = random_case(8, 49172, seed=8, dtype=torch.bfloat16)
    ours, reference = logits.cuda(), logits.clone()
    apply_bitmask(ours, bitmask.cuda(), torch.tensor([7, 2, -1], device="cuda"))
    ref_apply_bitmask(reference, bitmask, torch.tensor([7, 2, -1]))
    assert torch.equal(ours.cpu(), reference)
