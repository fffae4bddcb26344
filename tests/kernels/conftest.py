"""Shared pieces of the kernel tests: the device, per-dtype tolerances, seeded inputs.

Kernels run compiled on a GPU when there is one, else under Triton's interpreter on CPU tensors
(tests/conftest.py sets TRITON_INTERPRET=1 before any kernel module is imported).
"""

from __future__ import annotations

import zlib
from typing import Callable

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Why these tolerances:
# - f32: kernels compute in f32 exactly as the references do; only summation order and the
#   exp/rsqrt implementations differ, a few ulps of f32.
# - f16: results are rounded to f16 (1 ulp is 2^-10, about 1e-3 relative); a different f32 sum order
#   can flip that last rounding.
# - bf16: 1 ulp is 2^-8 (about 4e-3 relative). Fused kernels round twice where the references do
#   (e.g. normalize, then scale), attention rounds its probabilities to bf16 for the second product,
#   and Triton's interpreter truncates f32 -> bf16 instead of rounding to nearest, so two or three
#   ulps apart is expected; 2e-2 still catches any real error (a wrong mask or scale is off by far more).
TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
}



@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    """Fresh random inputs for every test case, reproducible from its id."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def assert_matches() -> Callable[[torch.Tensor, torch.Tensor], None]:
    """Compares a kernel's output with its reference at the tolerance of the output's dtype, after
    checking every element was written (outputs are filled with NaN before the kernel runs)."""

    def check(actual: torch.Tensor, expected: torch.Tensor) -> None:
        assert not torch.isnan(actual).any(), "the kernel left elements of its output unwritten (NaN poison)"
        torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[actual.dtype])

    return check


@pytest.fixture
def poisoned() -> Callable[..., torch.Tensor]:
    """Makes output buffers whose every element is NaN, so elements a kernel failed to write show."""

    def make(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)

    return make
