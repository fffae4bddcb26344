"""The sampler's random numbers: a counter-based hash of (seed, step, vocab id), no generator state.

Each request has a 64-bit seed; the noise for its token at generation step ``step`` and vocabulary
id ``v`` is a pure function of those three numbers, so a seeded request samples the same tokens
whatever else shares its batch, wherever its row sits, on any device, and after a restart. The
function is splitmix64 (Steele, Lea and Flood's generator; Stafford's "mix13" finalizer), spelled out
so that a Triton kernel can compute the same bits:

    mix64(x)  = z ^ (z >> 31)  where  z = ((y ^ (y >> 27)) * M2),  y = ((x ^ (x >> 30)) * M1)
    row_key   = mix64(mix64(seed) + step)
    bits[v]   = mix64(row_key + GOLDEN * (v + 1))          (the splitmix64 stream of row_key)
    uniform   = ((bits >> 12) + 0.5) * 2**-52               (float64, exactly; in (0, 1))
    gumbel    = -log(-log(uniform))                         (float64)

All arithmetic is on unsigned 64-bit integers modulo 2**64, shifts are logical. Torch has no
uint64 arithmetic, so here the values live in int64 (the same bits, two's complement) and each
right shift masks off the sign bits it drags in. Integer results are bit-exact on every backend;
the float64 ``log`` may differ by an ulp between math libraries, which can only change a sample
when two candidates tie to ~1e-16.
"""

from __future__ import annotations

import secrets

import torch

_U64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
M1 = 0xBF58476D1CE4E5B9
M2 = 0x94D049BB133111EB


def to_int64(value: int) -> int:
    """``value`` modulo 2**64, as the signed int64 with the same bits."""
    value &= _U64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN_I64, _M1_I64, _M2_I64 = to_int64(GOLDEN), to_int64(M1), to_int64(M2)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finalizer on int64 tensors (bijective on 64-bit patterns)."""
    x = (x ^ _shift_right(x, 30)) * _M1_I64
    x = (x ^ _shift_right(x, 27)) * _M2_I64
    return x ^ _shift_right(x, 31)


def mix64_int(x: int) -> int:
    """``mix64`` on a Python int, in exact unsigned arithmetic: the reference the tensor version
    (and any kernel) must match."""
    x &= _U64
    x = ((x ^ (x >> 30)) * M1) & _U64
    x = ((x ^ (x >> 27)) * M2) & _U64
    return x ^ (x >> 31)


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One key per row: ``mix64(mix64(seed) + step)``; int64 ``[B]``."""
    return mix64(mix64(seeds) + steps)


def random_bits(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """64 random bits per (row, vocab id); int64 ``[B, V]``."""
    counters = (torch.arange(1, vocab_size + 1, device=seeds.device, dtype=torch.int64) * _GOLDEN_I64)
    return mix64(row_keys(seeds, steps)[:, None] + counters[None, :])


def uniforms(bits: torch.Tensor) -> torch.Tensor:
    """Uniform float64 numbers in (0, 1) from the top 52 bits: never 0 or 1, so logs are finite."""
    return (_shift_right(bits, 12).to(torch.float64) + 0.5) * 2.0 ** -52


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise, float64 ``[B, V]``: argmax(logits + noise) samples softmax(logits)."""
    return -torch.log(-torch.log(uniforms(random_bits(seeds, steps, vocab_size))))


def new_seed() -> int:
    """A fresh seed for a request that gave none."""
    return secrets.randbits(63)


def child_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request asking for n samples: sample 0 keeps the request's
    seed (so n=1 and the first of n agree); the others get independent streams."""
    if index == 0:
        return to_int64(seed)
    return to_int64(mix64_int(seed + index * GOLDEN))
