"""The grouped LoRA decode kernels compile for a Hopper GPU (sm_90), checked on the CPU.

The interpreter runs a kernel's Python, not Triton's compiler: a kernel can pass every interpreted
test and still be refused by the compiler on the GPU (on 2026-12-05 the expand's per-slice loop
broke Triton 3.6's layout pass with "operand does not dominate this use" at three slices and 16
rows). Triton compiles for a named target without a GPU, so the shapes the decode path launches
are compiled here ahead of time, down to PTX and the cubin, in a process of their own (the kernels
of this test session are the interpreter's).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kiln.kernels import lora_decode_triton as kernels

HOPPER = GPUTarget("cuda", 90, 32)
_POINTER_TYPES = {"y_ptr": "*bf16", "x_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "norm_ptr": "*bf16",
                  "h_ptr": "*fp32", "part_ptr": "*fp32", "out_ptr": "*fp32", "sq_ptr": "*fp32",
                  "slot_ptr": "*i32", "q_start_ptr": "*i32", "q_len_ptr": "*i32"}


def _compile(kernel, constants: dict) -> None:
    """Compiles ``kernel`` for sm_90 with ``constants``; other arguments as bf16/f32/i32 pointers,
    f32 ``eps`` and i32 scalars, each 16-divisible as Triton specializes them at launch."""
    names = kernel.arg_names
    signature = {name: "constexpr" if name in constants else _POINTER_TYPES.get(name, "fp32" if name == "eps" else "i32")
                 for name in names}
    divisible = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
                 if signature[name] not in ("constexpr", "fp32")}
    compiled = triton.compile(ASTSource(kernel, signature, constants, divisible), target=HOPPER)
    assert compiled.asm["cubin"]


def compile_all() -> None:
    """The expand at one and three slices, with and without split planes, at 2 and 16 rows; the
    shrink with each prologue."""
    for slices in (1, 3):
        for split in (False, True):
            for block_b in (2, 16):
                _compile(kernels._expand_grouped, dict(
                    BLOCK_M=16, BLOCK_B=block_b, BLOCK_N=128, BLOCK_R=16, BLOCK_S=8, SLICES=slices, SPLIT=split,
                    SCALED=split, DOT_F32=False, PDL=True))
    for prologue in (0, 1, 2):
        _compile(kernels._shrink_grouped, dict(BLOCK_M=16, BLOCK_B=16, BLOCK_R=16, BLOCK_K=64, SPLIT=True,
                                               PROLOGUE=prologue, DOT_F32=False, PDL=True))


def test_grouped_decode_kernels_compile_for_hopper(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled afresh, not found in a cache
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-m", "tests.kernels.test_lora_compiles"], cwd=root, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


if __name__ == "__main__":
    compile_all()
