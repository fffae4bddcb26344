"""The quantized GEMMs' torch references against torch written out by hand, for every linear-family op
and every weight scheme, with and without per-token activation quantization, at odd sizes; and the
registry picking them by the weight's format."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.ir.types import DType, TensorType
from kiln.ir.weights import SCHEMES, QuantizedType, WeightFormat
from kiln.kernels import get_impl, select_impl
from kiln.kernels.quantize import E2M1, dequantize, quantize

T, K, N = 5, 96, 7  # odd rows and outputs; K a whole number of MX blocks
EPS = 1e-5
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def _weight(scheme: str) -> torch.Tensor:
    """A weight the scheme holds exactly, so the hand-written expectation is the plain weight: integers
    times a per-row scale for int8, fp8 values times one for fp8, e2m1 values times a power of two per
    block of 32 for mxfp4."""
    g = torch.Generator().manual_seed(7)
    if scheme == "int8_channel":
        ints = torch.randint(-127, 128, (N, K), generator=g).float()
        ints[:, 0] = 127  # each row's largest magnitude is 127: its scale is exactly the row's factor
        return ints * torch.rand(N, 1, generator=g)
    if scheme == "fp8_channel":
        values = (torch.randn(N, K, generator=g) * 50).to(torch.float8_e4m3fn).float()
        values[:, 0] = FP8_MAX
        return values * 2.0 ** torch.randint(-8, 0, (N, 1), generator=g).float()
    codes = torch.randint(0, 8, (N, K), generator=g)
    values = E2M1[codes] * torch.where(torch.rand(N, K, generator=g) < 0.5, -1.0, 1.0)
    values[:, ::32] = 6.0  # each block's largest magnitude is 6, so its exponent is the block's factor
    exponents = torch.randint(-6, 2, (N, K // 32), generator=g).float().repeat_interleave(32, dim=1)
    return values * 2.0 ** exponents


def _activations(x: torch.Tensor, act_quant: str | None) -> torch.Tensor:
    """Per-token quantize-dequantize, written out: each row scaled to its 8-bit type's range by its largest magnitude."""
    if act_quant is None:
        return x
    scale = x.abs().amax(dim=-1, keepdim=True)
    if act_quant == "int8_per_token":
        scale = scale / 127
        return (x / scale).round().clamp(-127, 127) * scale
    scale = scale / FP8_MAX
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


def _rmsnorm(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * g


CASES = [("int8_channel", None), ("int8_channel", "int8_per_token"), ("fp8_channel", "fp8_per_token"),
         ("mxfp4", None)]


@pytest.mark.parametrize("scheme,act_quant", CASES)
@pytest.mark.parametrize("op", ["linear", "rmsnorm_linear", "linear_residual", "silu_mul_linear_residual"])
def test_quantized_gemms_match_torch_by_hand(op: str, scheme: str, act_quant: str | None):
    torch.manual_seed(0)
    w = _weight(scheme)
    stored, scales = quantize(w, SCHEMES[scheme])
    x = torch.randn(T, 2 * K if op == "silu_mul_linear_residual" else K)
    g, bias, residual = torch.randn(K), torch.randn(N), torch.randn(T, N)
    attrs = {} if act_quant is None else {"act_quant": act_quant}
    kwargs = dict(weight_scales=scales, **attrs)
    if op == "linear":
        args, expected = (x, stored, bias), F.linear(_activations(x, act_quant), w, bias)
    elif op == "rmsnorm_linear":
        args, expected = (x, g, stored, bias), F.linear(_activations(_rmsnorm(x, g), act_quant), w, bias)
        kwargs["eps"] = EPS
    elif op == "linear_residual":
        args, expected = (x, stored, residual), F.linear(_activations(x, act_quant), w) + residual
    else:
        gated = F.silu(x[:, :K]) * x[:, K:]
        args, expected = (x, stored, residual), F.linear(_activations(gated, act_quant), w) + residual

    types = [TensorType(tuple(a.shape), DType.f32) for a in args]
    weight_index = 2 if op == "rmsnorm_linear" else 1
    types[weight_index] = QuantizedType(tuple(stored.shape), SCHEMES[scheme].storage,
                                        WeightFormat(SCHEMES[scheme], ("s",)))
    impl = select_impl(op, types, attrs, "torch")  # the triton backend's: test_linear_quantized_triton.py
    assert impl.name == f"torch.{op}.{scheme}"
    out = torch.full((T, N), float("nan"))
    get_impl(impl.name).fn(*args, out=out, **kwargs)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_bf16_activations_read_the_weight_in_bf16():
    w = _weight("int8_channel")
    stored, scales = quantize(w, SCHEMES["int8_channel"])
    x = torch.randn(T, K).bfloat16()
    out = torch.empty(T, N, dtype=torch.bfloat16)
    get_impl("torch.linear.int8_channel").fn(x, stored, out=out, weight_scales=scales, act_quant="int8_per_token")
    expected = F.linear(_activations(x.float(), "int8_per_token"), w)
    # bf16 rounds the dequantized weight, the activations and the output: a few ulps of the outputs' scale.
    torch.testing.assert_close(out.float(), expected, rtol=0, atol=2e-2 * expected.abs().max().item())


def test_mxfp4_decodes_every_byte_to_its_e2m1_pair():
    # Bytes 0-255 hold every (low, high) pair of codes; scale exponent 127 is 2^0.
    stored = torch.arange(256, dtype=torch.uint8).reshape(1, 256)
    values = dequantize(stored, (torch.full((1, 16), 127, dtype=torch.uint8),), SCHEMES["mxfp4"])
    low, high = stored.long() & 15, stored.long() >> 4
    expected = torch.stack([E2M1[c & 7] * (1 - 2 * (c >> 3)) for c in (low, high)], dim=-1).reshape(1, 512)
    assert torch.equal(values, expected)
