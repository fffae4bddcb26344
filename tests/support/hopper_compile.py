"""Compiling Triton kernels for a Hopper GPU (sm_90) on the CPU, ahead of time.

The interpreter runs a kernel's Python, not Triton's compiler: a kernel can pass every interpreted
test and still be refused by the compiler on the GPU. Triton compiles for a named target without a
GPU, so the ``test_*_compiles.py`` tests compile the variants a path launches, down to PTX and the
cubin, in a process of their own (the kernels of a test session are the interpreter's): the test
runs its own module as ``python -m`` without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Mapping

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)


def compile_for_hopper(kernel, constants: Mapping[str, object], pointer_types: Mapping[str, str],
                       not_divisible: frozenset[str] = frozenset(), num_warps: int = 4) -> None:
    """Compiles ``kernel`` for sm_90 with ``constants`` at ``num_warps``; arguments named in
    ``pointer_types`` as those pointers, ``eps`` as f32, the rest as i32 scalars; pointers and scalars
    16-divisible, as Triton specializes them at launch, but for those in ``not_divisible``."""
    names = kernel.arg_names
    signature = {name: "constexpr" if name in constants else pointer_types.get(name, "fp32" if name == "eps" else "i32")
                 for name in names}
    divisible = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
                 if signature[name] not in ("constexpr", "fp32") and name not in not_divisible}
    compiled = triton.compile(ASTSource(kernel, signature, dict(constants), divisible), target=HOPPER,
                              options={"num_warps": num_warps})
    assert compiled.asm["cubin"]


def run_compile_module(module: str, cache_dir: Path) -> None:
    """Runs ``python -m module`` from the repository root without the interpreter, compiling afresh
    into ``cache_dir`` (not found in a cache); fails with the end of its stderr."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-m", module], cwd=root, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
