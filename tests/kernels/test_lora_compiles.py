"""The LoRA kernels (the step's grouping, the hooks' one-row and tile kernels) compile for a Hopper GPU
(sm_90), checked on the CPU.

The interpreter runs a kernel's Python, not Triton's compiler: a kernel can pass every interpreted
test and still be refused by the compiler on the GPU (on 2026-12-05 the expand's per-slice loop
broke Triton 3.6's layout pass with "operand does not dominate this use" at three slices and 16
rows). Triton compiles for a named target without a GPU, so every variant the LoRA path launches
is compiled here ahead of time, down to PTX and the cubin, in a process of their own (the kernels
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

from kiln.kernels import lora_groups, lora_row_triton, lora_tile_triton, moe_align

HOPPER = GPUTarget("cuda", 90, 32)
_POINTER_TYPES = {"y_ptr": "*bf16", "x_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "norm_ptr": "*bf16",
                  "h_ptr": "*fp32", "part_ptr": "*fp32", "out_ptr": "*fp32", "sq_ptr": "*fp32",
                  "slot_ptr": "*i32", "q_start_ptr": "*i32", "q_len_ptr": "*i32", "rows_ptr": "*i32",
                  "tiles_ptr": "*i32", "counter_ptr": "*i32"}
# The grouping's pointers are all int32 (its out_ptr too).
_GROUPING_TYPES = {name: "*i32" for name in ("out_ptr", "ids_ptr", "sorted_ptr", "block_experts_ptr", "total_ptr")}
# An f32 artifact's activations and adapters (test_gpu_lora.py runs one): products on f32 operands (DOT_F32).
_F32_TYPES = {name: "*fp32" for name in ("y_ptr", "x_ptr", "a_ptr", "b_ptr", "norm_ptr")}


def _compile(kernel, constants: dict, pointers: dict | None = None) -> None:
    """Compiles ``kernel`` for sm_90 with ``constants``; other arguments as bf16/f32/i32 pointers
    (``pointers`` overriding the usual types), f32 ``eps`` and i32 scalars, each 16-divisible as
    Triton specializes them at launch."""
    names, types = kernel.arg_names, {**_POINTER_TYPES, **(pointers or {})}
    signature = {name: "constexpr" if name in constants else types.get(name, "fp32" if name == "eps" else "i32")
                 for name in names}
    divisible = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
                 if signature[name] not in ("constexpr", "fp32")}
    compiled = triton.compile(ASTSource(kernel, signature, constants, divisible), target=HOPPER)
    assert compiled.asm["cubin"]


def compile_all() -> None:
    """The step's grouping; the expands at one and three slices; the shrinks with each prologue, with
    and without split K (whose last split merges the planes); the tile kernels in f32 too."""
    _compile(lora_groups._token_slots, dict(BLOCK_T=128, BLOCK_B=64), _GROUPING_TYPES)
    _compile(moe_align._moe_align_kernel, dict(BLOCK_M=16, E_POW2=8, CHUNK=64), _GROUPING_TYPES)
    for slices in (1, 3):
        _compile(lora_tile_triton._expand_tile, dict(BLOCK_M=16, BLOCK_N=128, BLOCK_R=16, SLICES=slices,
                                                     DOT_F32=False, PDL=True))
        _compile(lora_row_triton._expand_row, dict(BLOCK_N=256, BLOCK_R=16, SLICES=slices, PDL=True))
    for prologue in (0, 1, 2):
        for split in (False, True):
            _compile(lora_tile_triton._shrink_tile, dict(BLOCK_M=16, BLOCK_R=16, BLOCK_K=64, SPLIT=split,
                                                         PROLOGUE=prologue, DOT_F32=False, PDL=True))
            _compile(lora_row_triton._shrink_row, dict(BLOCK_R=16, BLOCK_K=128, NORM_BLOCK=2048, PROLOGUE=prologue,
                                                       SPLIT=split, PDL=True))
    _compile(lora_tile_triton._shrink_tile, dict(BLOCK_M=16, BLOCK_R=64, BLOCK_K=64, SPLIT=True, PROLOGUE=1,
                                                 DOT_F32=True, PDL=False), _F32_TYPES)
    _compile(lora_tile_triton._expand_tile, dict(BLOCK_M=16, BLOCK_N=128, BLOCK_R=64, SLICES=3, DOT_F32=True,
                                                 PDL=False), _F32_TYPES)


def test_lora_kernels_compile_for_hopper(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled afresh, not found in a cache
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-m", "tests.kernels.test_lora_compiles"], cwd=root, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


if __name__ == "__main__":
    compile_all()
