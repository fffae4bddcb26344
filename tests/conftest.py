"""Shared fixtures: the real SmolLM2 model (converted once per cache), and Triton's interpreter on CPU.

Triton kernels run under ``TRITON_INTERPRET=1`` when no GPU is present; the variable is read when
kernels are decorated, so it is set here before any kernel module is imported.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_GPU = torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_dir():
    """The HF-layout directory of the real SmolLM2-135M-Instruct, fetched into KILN_HOME on first use."""
    from kiln.compiler.sources.aliases import resolve_model

    return resolve_model("smollm2-135m-instruct")
