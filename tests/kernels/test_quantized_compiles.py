"""The quantized GEMM kernels compile for a Hopper GPU (sm_90), checked on the CPU.

The interpreter runs a kernel's Python, not Triton's compiler (see test_kernels_compile_for_hopper.py): every
variant the quantized linear ops launch is compiled here ahead of time, down to the cubin, in a
process of its own, with the tiles and warps ``row_constants`` and ``quantized_gemv_tiles`` pick for Llama-3-8B's shapes
on an H100: the one-row GEMV (each scheme, W8A8 quantizing in it), at 16 rows (tl.dot), the GEMM
tile at 64 rows, each prologue and epilogue; the activation quantizer from one tile and from several passes;
the dequantizer of the library path.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kiln.kernels import act_quant_triton, gemm_quantized, gemv_mma, gemv_quantized, gemv_quantized_row
from kiln.kernels.act_quant_triton import ACT_FP8, ACT_INT8, ACT_KINDS, ACT_NONE
from kiln.kernels.config import DEFAULTS
from kiln.kernels.gemv import NORM, RAW, SILU_MUL
from kiln.kernels.gemv_quantized import quantized_gemv_tiles
from kiln.kernels.quant_decode import MXFP4, PER_CHANNEL

HOPPER = GPUTarget("cuda", 90, 32)
H100_SMS = 132
# Storage and scale pointer types of each weight kind: (x, w, s) for the GEMV.
_WEIGHTS = {"int8": ("*i8", "*fp32"), "fp8": ("*fp8e4nv", "*fp32"), "mxfp4": ("*u8", "*u8")}
_ACT_X = {ACT_NONE: "*bf16", ACT_INT8: "*i8", ACT_FP8: "*fp16"}  # as the GEMV reads x


def _compile(kernel, pointers: dict[str, str], constants: dict, num_warps: int = 4, num_stages: int = 1):
    """Compiles ``kernel`` for sm_90 with ``constants``: ``pointers`` names each pointer argument's
    type, ``eps`` is f32 and the rest i32 scalars, each non-constant 16-divisible as Triton
    specializes them at launch."""
    names = kernel.arg_names
    signature = {name: "constexpr" if name in constants else pointers.get(name, "fp32" if name == "eps" else "i32")
                 for name in names}
    divisible = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
                 if signature[name] not in ("constexpr", "fp32")}
    compiled = triton.compile(ASTSource(kernel, signature, constants, divisible), target=HOPPER,
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    assert compiled.asm["cubin"]
    return compiled


def _row_gemv(weight: str, act, prologue, n: int, k: int, bias: bool, residual: bool):
    """The one-row GEMV as ``launch_quantized_row_gemv`` launches it for an [n, k] weight and bf16 x."""
    w_type, s_type = _WEIGHTS[weight]
    act_quant = next(name for name, kind in ACT_KINDS.items() if kind == act)
    constants, warps = gemv_quantized_row.row_constants(n, k, H100_SMS, pack=2 if weight == "mxfp4" else 1,
                                                        fp8=weight == "fp8", act_quant=act_quant, prologue=prologue,
                                                        x_bytes=2)
    pointers = dict(x_ptr="*bf16", nw_ptr="*bf16", w_ptr=w_type, s_ptr=s_type, b_ptr="*bf16", r_ptr="*bf16",
                    y_ptr="*bf16")
    return _compile(gemv_quantized_row._qgemv_row_kernel, pointers, dict(
        constants, HAS_BIAS=bias, HAS_RESIDUAL=residual, HARDWARE=True, PDL=True), warps)


def _gemv(weight: str, act, prologue, rows: int, n: int, k: int, bias: bool, residual: bool) -> None:
    """The GEMV as ``launch_quantized_gemv`` launches it for ``rows`` (2 or more) rows of an [n, k] weight."""
    w_type, s_type = _WEIGHTS[weight]
    block_t, block_n, block_k, warps, stages = quantized_gemv_tiles(rows, n, k, H100_SMS, 2 if weight == "mxfp4" else 1)
    pointers = dict(x_ptr=_ACT_X[act], xs_ptr="*fp32", nw_ptr="*bf16", w_ptr=w_type, s_ptr=s_type, b_ptr="*bf16",
                    r_ptr="*bf16", y_ptr="*bf16")
    _compile(gemv_quantized._qgemv_kernel, pointers, dict(
        WEIGHT=MXFP4 if weight == "mxfp4" else PER_CHANNEL, ACT=act, PROLOGUE=prologue,
        HAS_BIAS=bias, HAS_RESIDUAL=residual, DOT_F32=False, DOT_IN_DTYPE=True,
        BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k, PASS_K=max(16, 4096 // block_t), PDL=True), warps, stages)


def compile_all() -> None:
    # Llama-3-8B's qkv (RMSNorm prologue) and down projection (SiLU·mul prologue, residual epilogue),
    # and a plain GEMM with a bias at one row; W8A8 GEMVs read quantized rows (no prologue; at 64 rows
    # the GPU runs _scaled_mm / _int_mm unless quantized_gemv_max_rows says otherwise).
    for weight, act in (("fp8", ACT_FP8), ("int8", ACT_INT8), ("int8", ACT_NONE), ("mxfp4", ACT_NONE)):
        for (n, k), prologue, residual in (((6144, 4096), NORM, False), ((4096, 14336), SILU_MUL, True)):
            _row_gemv(weight, act, prologue, n, k, False, residual)
            for rows in (16, 64):
                _gemv(weight, act, prologue if act == ACT_NONE else RAW, rows, n, k, False, residual)
    _row_gemv("mxfp4", ACT_NONE, RAW, 4096, 4096, True, False)
    for rows in (16, 64):
        _gemv("mxfp4", ACT_NONE, RAW, rows, 4096, 4096, True, False)
    for act, q_type in ((ACT_FP8, "*fp8e4nv"), (ACT_FP8, "*fp16"), (ACT_INT8, "*i8")):
        for prologue, one_tile in ((NORM, True), (SILU_MUL, True), (RAW, False)):
            _compile(act_quant_triton._quantize_rows_kernel,
                     dict(x_ptr="*bf16", nw_ptr="*bf16", q_ptr=q_type, s_ptr="*fp32"),
                     dict(PROLOGUE=prologue, ACT=act, HARDWARE=True, BLOCK_K=16384 if one_tile else 2048,
                          ONE_TILE=one_tile, PDL=True), DEFAULTS.act_quant_num_warps)
    for (weight, act, x_type, mma), quantizes in itertools.product(
            (("fp8", ACT_FP8, "*fp8e4nv", "m64n16k32.f32.e4m3.e4m3"), ("int8", ACT_INT8, "*i8", "m64n16k32.s32.s8.s8")),
            (False, True)):
        # gemv_mma exists to run wgmma on the 8-bit values as stored: no conversion, no mma.sync; with
        # its own quantizer (x bf16, the SiLU·mul prologue) as well.
        block_n, block_t, block_k = gemv_mma.mma_gemv_tiles(1, 4096, input_bytes=2 if quantizes else None)
        pointers = dict(x_ptr="*bf16" if quantizes else x_type, xs_ptr="*fp32", nw_ptr="*bf16",
                        w_ptr=_WEIGHTS[weight][0], s_ptr="*fp32", b_ptr="*bf16", r_ptr="*bf16", y_ptr="*bf16")
        ptx = _compile(gemv_mma._mma_gemv_kernel, pointers,
                       dict(ACT=act, QUANTIZE=quantizes, PROLOGUE=SILU_MUL if quantizes else RAW, HARDWARE=True,
                            HAS_BIAS=False, HAS_RESIDUAL=True, DOT_F32=False, BLOCK_N=block_n, BLOCK_T=block_t,
                            BLOCK_K=block_k, PASS_K=256, PROMOTE_EVERY=gemv_mma.FP8_PROMOTE_EVERY, PDL=True),
                       4, DEFAULTS.mma_gemv_num_stages).asm["ptx"]
        assert f"wgmma.mma_async.sync.aligned.{mma}" in ptx and "mma.sync" not in ptx, f"{weight}: no {mma} wgmma"
    for weight in ("fp8", "mxfp4"):
        w_type, s_type = _WEIGHTS[weight]
        _compile(gemm_quantized._dequantize_kernel, dict(w_ptr=w_type, s_ptr=s_type, out_ptr="*bf16"),
                 dict(WEIGHT=MXFP4 if weight == "mxfp4" else PER_CHANNEL,
                      BLOCK_N=16, BLOCK_K=256))


def test_quantized_kernels_compile_for_hopper(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled afresh, not found in a cache
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-m", "tests.kernels.test_quantized_compiles"], cwd=root, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


if __name__ == "__main__":
    compile_all()
