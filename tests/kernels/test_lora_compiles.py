"""The grouped LoRA decode kernels compile for a Hopper GPU (sm_90), checked on the CPU.

On 2026-12-05 the expand's per-slice loop passed every interpreted test and broke Triton 3.6's
layout pass with "operand does not dominate this use" at three slices and 16 rows: the shapes the
decode path launches are compiled here ahead of time (``tests/support/hopper_compile.py``).
"""

from __future__ import annotations

from kiln.kernels import lora_decode_triton as kernels
from tests.support.hopper_compile import compile_for_hopper, run_compile_module

_POINTER_TYPES = {"y_ptr": "*bf16", "x_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "norm_ptr": "*bf16",
                  "h_ptr": "*fp32", "part_ptr": "*fp32", "out_ptr": "*fp32", "sq_ptr": "*fp32",
                  "slot_ptr": "*i32", "q_start_ptr": "*i32", "q_len_ptr": "*i32"}


def compile_all() -> None:
    """The expand at one and three slices, with and without split planes, at 2 and 16 rows; the
    shrink with each prologue."""
    for slices in (1, 3):
        for split in (False, True):
            for block_b in (2, 16):
                compile_for_hopper(kernels._expand_grouped, dict(
                    BLOCK_M=16, BLOCK_B=block_b, BLOCK_N=128, BLOCK_R=16, BLOCK_S=8, SLICES=slices, SPLIT=split,
                    SCALED=split, DOT_F32=False, PDL=True), _POINTER_TYPES)
    for prologue in (0, 1, 2):
        compile_for_hopper(kernels._shrink_grouped, dict(BLOCK_M=16, BLOCK_B=16, BLOCK_R=16, BLOCK_K=64, SPLIT=True,
                                                         PROLOGUE=prologue, DOT_F32=False, PDL=True), _POINTER_TYPES)


def test_grouped_decode_kernels_compile_for_hopper(tmp_path):
    run_compile_module("tests.kernels.test_lora_compiles", tmp_path)


if __name__ == "__main__":
    compile_all()
