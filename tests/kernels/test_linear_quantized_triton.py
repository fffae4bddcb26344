"""The triton backend's quantized linear-family kernels against the ``torch.<op>.<scheme>`` references:
every op (each fusion), every weight scheme with and without per-token activation quantization, at
odd sizes, on the GEMV (1, 3, 16 rows; 20 in row blocks; 64 in the GEMM tile) and, on a GPU, through the library GEMMs
(``_scaled_mm``, ``_int_mm``, dequantize + cuBLAS) at many rows. Runs under Triton's interpreter
on the CPU; the GPU cases are skipped there."""

from __future__ import annotations

import pytest
import torch

from kiln.ir.types import DType, TensorType
from kiln.ir.weights import SCHEMES, QuantizedType, WeightFormat
from kiln.kernels import KernelConfig, get_impl, select_impl
from kiln.kernels.gemm_quantized import dequantize_weight, library_gemm, library_path
from kiln.kernels.quantize import dequantize, quantize

from .conftest import DEVICE

OPS = ["linear", "rmsnorm_linear", "linear_residual", "silu_mul_linear_residual"]
CASES = [("int8_channel", None), ("int8_channel", "int8_per_token"), ("fp8_channel", "fp8_per_token"),
         ("mxfp4", None)]
EPS = 1e-5
# f32: the kernel sums exactly what the reference sums, in another order (and the activation and
# weight scales multiply the sum instead of each term): a few ulps of f32 on outputs of unit scale.
# bf16: the reference rounds the prologue's output and the GEMM's; Triton's interpreter truncates
# where it rounds, and one ulp of a normalized input can move an 8-bit activation by a step: as
# test_linear_fused's bf16 bound. A wrong scale, block or nibble order is off by far more.
# With fp8 activations such a flip moves an input by a whole e4m3 step (1/16 to 1/8 of it), so bf16
# outputs of unit scale may move by ~0.1 where a few inputs flip.
TOLERANCES = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=4e-2, atol=6e-2)}
FP8_BF16_TOLERANCE = dict(rtol=4e-2, atol=0.15)


def _tolerance(dtype: torch.dtype, act_quant: str | None) -> dict[str, float]:
    return FP8_BF16_TOLERANCE if (dtype, act_quant) == (torch.bfloat16, "fp8_per_token") else TOLERANCES[dtype]


def _k(scheme: str) -> int:
    return 96 if scheme == "mxfp4" else 200  # mxfp4: three blocks of 32; else no power of two


def _operands(op: str, scheme: str, rows: int, n: int, dtype: torch.dtype, has_bias: bool = True,
              k: int | None = None):
    """The op's inputs (x first, the stored weight where the op takes it) and its scales."""
    k = k or _k(scheme)
    weight = torch.randn(n, k) * k ** -0.5
    stored, scales = quantize(weight, SCHEMES[scheme])
    stored, scales = stored.to(DEVICE), tuple(s.to(DEVICE) for s in scales)
    x = torch.randn(rows, 2 * k if op == "silu_mul_linear_residual" else k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype) if has_bias else None
    residual = torch.randn(rows, n, device=DEVICE).to(dtype)
    if op == "linear":
        return (x, stored, bias), scales
    if op == "rmsnorm_linear":
        return (x, torch.randn(k, device=DEVICE).to(dtype), stored, bias), scales
    return (x, stored, residual), scales


# The GEMVs other GPUs run (and Hopper above gemv_mma's rows); test_gemv_mma.py tests gemv_mma's.
NO_MMA = KernelConfig(mma_gemv_max_rows=0)


def _run(op: str, scheme: str, act_quant: str | None, args, scales, backend_impl: str, config=None):
    config = config or NO_MMA
    x = args[0]
    weight_index = 2 if op == "rmsnorm_linear" else 1
    n = args[weight_index].shape[0]
    kwargs = dict(weight_scales=scales, act_quant=act_quant)
    if op == "rmsnorm_linear":
        kwargs["eps"] = EPS
    if backend_impl == "triton":
        kwargs["config"] = config
    out = torch.full((x.shape[0], n), float("nan"), dtype=x.dtype, device=x.device)
    get_impl(f"{backend_impl}.{op}.{scheme}").fn(*args, out=out, **kwargs)
    return out


def _assert_matches(op: str, scheme: str, act_quant: str | None, args, scales, config=None,
                    tolerance: dict[str, float] | None = None) -> None:
    out = _run(op, scheme, act_quant, args, scales, "triton", config)
    expected = _run(op, scheme, act_quant, args, scales, "torch")
    what = f"triton.{op}.{scheme} (act_quant={act_quant}, x {tuple(args[0].shape)} {args[0].dtype})"
    assert not torch.isnan(out).any(), f"{what} left elements of its output unwritten (NaN poison)"
    torch.testing.assert_close(out.float(), expected.float(), **(tolerance or _tolerance(out.dtype, act_quant)),
                               msg=lambda m: f"{what} differs from torch.{op}.{scheme}: {m}")


@pytest.mark.parametrize("rows", [1, 3, 16, 20])
@pytest.mark.parametrize("scheme,act_quant", CASES)
@pytest.mark.parametrize("op", OPS)
def test_gemv_matches_reference(op, scheme, act_quant, rows):
    # 20 rows above the GEMV's 16 still take it here (no library GEMM on the CPU), in row blocks of 16.
    args, scales = _operands(op, scheme, rows, 37, torch.float32, has_bias=rows != 3)
    _assert_matches(op, scheme, act_quant, args, scales, KernelConfig(quantized_gemv_block_t=16, mma_gemv_max_rows=0))


@pytest.mark.parametrize("scheme,act_quant", CASES)
@pytest.mark.parametrize("op", OPS)
def test_gemm_tile_matches_reference(op, scheme, act_quant):
    # 64 rows in one row block with the GEMM tile (quantized_gemm_block_n columns, two tiles here, the
    # second partial) stepping through K in quantized_gemm_block_k steps, the last one partial.
    args, scales = _operands(op, scheme, 64, 70, torch.float32)
    _assert_matches(op, scheme, act_quant, args, scales)


@pytest.mark.parametrize("n,k", [(5, 32), (37, 416), (70, 1088)])
@pytest.mark.parametrize("scheme,act_quant", CASES)
def test_one_row_gemv_at_odd_shapes(scheme, act_quant, n, k):
    # gemv_quantized_row: N not a multiple of its column tile, K of one MX block to several K tiles
    # (one warp: K steps of 4 f32 values a thread, 128; quantized_gemv_product_elements 256 values),
    # the last one partial.
    args, scales = _operands("rmsnorm_linear", scheme, 1, n, torch.float32, k=k)
    _assert_matches("rmsnorm_linear", scheme, act_quant, args, scales,
                    KernelConfig(quantized_gemv_product_elements=256, gemv_one_step_max_k=256, mma_gemv_max_rows=0,
                                 quantized_gemv_num_warps=1))


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("scheme,act_quant", CASES)
@pytest.mark.parametrize("op", ["rmsnorm_linear", "silu_mul_linear_residual"])
def test_gemv_matches_reference_in_bf16(op, scheme, act_quant, rows):
    args, scales = _operands(op, scheme, rows, 24, torch.bfloat16)
    _assert_matches(op, scheme, act_quant, args, scales)


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("scheme", ["int8_channel", "fp8_channel", "mxfp4"])
def test_gemv_steps_through_k(scheme, rows):
    # K past gemv_one_step_max_k (one row) and quantized_gemv_dot_block_k (more): several K tiles,
    # the next one's loads in flight.
    k, n = 2304, 12
    weight = torch.randn(n, k) * k ** -0.5
    stored, scales = quantize(weight, SCHEMES[scheme])
    args = (torch.randn(rows, k, device=DEVICE), stored.to(DEVICE), None)
    act_quant = "fp8_per_token" if scheme == "fp8_channel" else None
    _assert_matches("linear", scheme, act_quant, args, tuple(s.to(DEVICE) for s in scales),
                    KernelConfig(gemv_one_step_max_k=1024, mma_gemv_max_rows=0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", ["int8_channel", "fp8_channel", "mxfp4"])
def test_dequantize_kernel_matches_reference(scheme, dtype):
    stored, scales = quantize(torch.randn(37, _k(scheme)), SCHEMES[scheme])
    stored, scales = stored.to(DEVICE), tuple(s.to(DEVICE) for s in scales)
    dense = dequantize_weight(stored, scales[0], SCHEMES[scheme], dtype)
    expected = dequantize(stored, scales, SCHEMES[scheme])
    if dtype == torch.float32:
        assert torch.equal(dense, expected)
    else:  # one rounding to bf16 (the interpreter's truncates: an ulp, 2^-8 relative, at most)
        torch.testing.assert_close(dense.float(), expected, rtol=2 ** -7, atol=0)


def _types(op: str, scheme: str, x_dtype: DType, norm_dtype: DType | None = None) -> list[TensorType]:
    k = _k(scheme)
    stored = QuantizedType((37, k // SCHEMES[scheme].pack), SCHEMES[scheme].storage,
                           WeightFormat(SCHEMES[scheme], ("s",)))
    x = TensorType((5, 2 * k if op == "silu_mul_linear_residual" else k), x_dtype)
    if op == "rmsnorm_linear":
        return [x, TensorType((k,), norm_dtype or x_dtype), stored]
    if op == "linear":
        return [x, stored]
    return [x, stored, TensorType((5, 37), x_dtype)]


@pytest.mark.parametrize("scheme,act_quant", CASES)
@pytest.mark.parametrize("op", OPS)
def test_registry_picks_the_triton_kernel_by_weight_format(op, scheme, act_quant):
    attrs = {"act_quant": act_quant}
    assert select_impl(op, _types(op, scheme, DType.bf16), attrs, "triton").name == f"triton.{op}.{scheme}"
    assert select_impl(op, _types(op, scheme, DType.bf16), attrs, "torch").name == f"torch.{op}.{scheme}"


def test_registry_leaves_mixed_dtypes_to_the_reference():
    types = _types("rmsnorm_linear", "fp8_channel", DType.bf16, norm_dtype=DType.f32)
    assert select_impl("rmsnorm_linear", types, {"act_quant": "fp8_per_token"}, "triton").name == \
        "torch.rmsnorm_linear.fp8_channel"


def test_bad_operands_are_refused_with_what_is_wrong():
    args, scales = _operands("linear", "int8_channel", 2, 8, torch.float32)
    with pytest.raises(ValueError, match=r"triton.linear.int8_channel: a int8_channel weight is torch.int8"):
        _run("linear", "int8_channel", None, (args[0], args[1].float(), None), scales, "triton")
    with pytest.raises(ValueError, match=r"weight scale .* must be contiguous f32 \[8\]"):
        _run("linear", "int8_channel", None, args, (scales[0].double(),), "triton")
    with pytest.raises(ValueError, match=r"act_quant 'int4' is none of"):
        _run("linear", "int8_channel", "int4", args, scales, "triton")
    with pytest.raises(ValueError, match=r"x \(2, 100\) must be \[T, K\]"):
        _run("linear", "int8_channel", None, (args[0][:, :100], args[1], None), scales, "triton")


# --- the library GEMMs at many rows: called directly here (torch runs _scaled_mm and _int_mm on the
# CPU too), chosen by the launcher on the GPU ---------------------------------------------------------

GPU_CASES = [("int8_channel", None, "dequantized"), ("int8_channel", "int8_per_token", "int_mm"),
             ("fp8_channel", "fp8_per_token", "scaled_mm"), ("mxfp4", None, "dequantized")]


@pytest.mark.parametrize("scheme,act_quant,path", GPU_CASES)
@pytest.mark.parametrize("op", OPS)
def test_library_gemms_match_reference(op, scheme, act_quant, path):
    # linear without a bias (the GEMM writes the output itself), rmsnorm_linear with one; K and N as
    # the GPU's _scaled_mm wants them (multiples of 16).
    args, scales = _operands(op, scheme, 40, 96, torch.bfloat16, has_bias=op != "linear", k=256)
    weight_index = 2 if op == "rmsnorm_linear" else 1
    x, weight = args[0], args[weight_index]
    if op == "linear":
        fused = dict(bias=args[2])
    elif op == "rmsnorm_linear":
        fused = dict(norm_weight=args[1], bias=args[3], eps=EPS)
    else:
        fused = dict(residual=args[2], gated=op == "silu_mul_linear_residual")
    out = torch.full((x.shape[0], weight.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    library_gemm(path, x, weight, scales[0], out, scheme=SCHEMES[scheme], act_quant=act_quant, **fused)
    expected = _run(op, scheme, act_quant, args, scales, "torch")
    torch.testing.assert_close(out.float(), expected.float(), **_tolerance(out.dtype, act_quant),
                               msg=lambda m: f"{path} for {op}.{scheme} differs from the reference: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [100, 300])
@pytest.mark.parametrize("scheme,act_quant,path", GPU_CASES)
@pytest.mark.parametrize("op", OPS)
def test_library_gemms_match_reference_on_gpu(op, scheme, act_quant, path, rows):
    if scheme == "fp8_channel" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9 or later")
    # K and N multiples of 16 (_scaled_mm) and 8 (_int_mm); rows past both row limits.
    args, scales = _operands(op, scheme, rows, 96, torch.bfloat16, k=256)
    x, stored = args[0], args[2 if op == "rmsnorm_linear" else 1]
    assert library_path(x, stored, SCHEMES[scheme], act_quant) == path, \
        f"expected the {path} path for {scheme}/{act_quant} at {rows} rows"
    _assert_matches(op, scheme, act_quant, args, scales)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("scheme,act_quant", CASES)
def test_gemv_at_llama_shapes_on_gpu(scheme, act_quant, rows):
    # Llama-3-8B's down projection (K 14336) compiled for the GPU: the tiles gemv_config picks there
    # (64 rows in the GEMV's GEMM tile, W8A8 included; one row in gemv_quantized_row).
    if "fp8" in scheme and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9 or later")
    n, k = 512, 14336
    weight = torch.randn(n, k) * k ** -0.5
    stored, scales = quantize(weight, SCHEMES[scheme])
    x, residual = torch.randn(rows, k, device="cuda").bfloat16(), torch.randn(rows, n, device="cuda").bfloat16()
    args = (x, stored.cuda(), residual)
    _assert_matches("linear_residual", scheme, act_quant, args, tuple(s.cuda() for s in scales),
                    KernelConfig(quantized_gemv_max_rows=64, mma_gemv_max_rows=0))

