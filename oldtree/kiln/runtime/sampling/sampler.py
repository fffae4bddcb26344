"""The batched sampler: next tokens (and logprobs) from a step's logits ``[B, V]``.

Per batch, ``SamplingBatch.pack(rows)`` turns each row's ``SamplingParams``, seed, step index and
token history into tensors once; ``sample(logits, batch, allowed_mask, kernels)`` then runs on any
device:

1. logprobs, when any row asks, are ``log_softmax`` of the logits as the model gave them: the raw
   model distribution, before penalties, bias, grammar, temperature and filtering (vLLM's default).
2. penalties: repetition as in HF (positive logits divided, negative multiplied, for tokens in the
   prompt or output); frequency and presence as in OpenAI (``-= freq * count + presence * (count > 0)``
   over output tokens). Then ``logit_bias`` is added and ``allowed_mask`` (grammar) applied.
3. greedy rows (temperature 0) take the argmax (ties: lowest id).
4. sampled rows: divide by temperature, filter top-k, then top-p, then min-p, and take
   ``argmax(logits + gumbel)``, the Gumbel-max trick, with noise from ``rng`` keyed by
   (seed, step, vocab id): reproducible per request, independent of the rest of the batch.

The kernels (masking, argmax, the draw) come from the kernel registry as ``SamplerKernels``: Triton's
on a GPU, bound to the artifact's kernel config, the torch references elsewhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from kiln.kernels import impl_for_device, rng
from kiln.kernels.config import DEFAULTS, KernelConfig

from .params import SamplingParams


@dataclass(frozen=True)
class SamplerKernels:
    """The sampler's runtime ops for one device (see ``kiln.kernels.registry``), config bound."""

    argmax_rows: Callable[..., torch.Tensor]  # (logits, bitmask=None) -> i64 [B]
    apply_bitmask: Callable[..., None]  # (logits, bitmask, rows=None): in place
    sample_rows: Callable[..., torch.Tensor]  # (scores, temperature, top_k, ..., use_min_p) -> i64 [B]

    @classmethod
    def for_device(cls, device: torch.device | str, config: KernelConfig = DEFAULTS) -> "SamplerKernels":
        device = torch.device(device)
        ops = ("argmax_rows", "apply_bitmask", "sample_rows")
        return cls(*(impl_for_device(op, device).bound(config) for op in ops))


@dataclass(frozen=True)
class SamplingRow:
    """One sequence in the batch: its params, its resolved seed (``rng.new_seed()`` when the request
    gave none), the index of the token being generated (0 for the first), and its token history,
    read only when penalties are on."""

    params: SamplingParams
    seed: int
    step: int
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as tensors ``[B]``, plus host-side flags saying which stages any
    row needs (stages no row needs are skipped)."""

    temperature: torch.Tensor  # f32; 1.0 on greedy rows, which never use it
    greedy: torch.Tensor  # bool
    top_k: torch.Tensor  # i64; the vocabulary size when off
    top_p: torch.Tensor  # f32
    min_p: torch.Tensor  # f32
    repetition_penalty: torch.Tensor  # f32
    frequency_penalty: torch.Tensor  # f32
    presence_penalty: torch.Tensor  # f32
    seeds: torch.Tensor  # i64
    steps: torch.Tensor  # i64; the engine may advance it in place (+= 1) between steps
    prompt_ids: torch.Tensor | None  # i64 [B, Lp], padded with -1; only when penalties are on
    output_ids: torch.Tensor | None  # i64 [B, Lo], padded with -1
    bias_rows: torch.Tensor | None  # i64 [N]: logit_bias as (row, token id, value) triples
    bias_ids: torch.Tensor | None
    bias_values: torch.Tensor | None  # f32 [N]
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    use_penalties: bool
    want_logprobs: bool
    max_top_logprobs: int

    @classmethod
    def pack(cls, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device | str = "cpu") -> "SamplingBatch":
        params = [row.params for row in rows]

        def floats(values: Sequence[float]) -> torch.Tensor:
            return _to_device(torch.tensor(values, dtype=torch.float32), device)

        def ints(values: Sequence[int]) -> torch.Tensor:
            return _to_device(torch.tensor(values, dtype=torch.int64), device)

        greedy = [p.greedy for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        use_penalties = any(p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty for p in params)
        bias = [(i, token, value) for i, p in enumerate(params) for token, value in p.logit_bias.items()]
        return cls(
            temperature=floats([1.0 if g else p.temperature for g, p in zip(greedy, params)]),
            greedy=_to_device(torch.tensor(greedy, dtype=torch.bool), device),
            top_k=ints(top_k), top_p=floats([p.top_p for p in params]), min_p=floats([p.min_p for p in params]),
            repetition_penalty=floats([p.repetition_penalty for p in params]),
            frequency_penalty=floats([p.frequency_penalty for p in params]),
            presence_penalty=floats([p.presence_penalty for p in params]),
            seeds=ints([rng.to_int64(row.seed) for row in rows]), steps=ints([row.step for row in rows]),
            prompt_ids=_pad([row.prompt_ids for row in rows], device) if use_penalties else None,
            output_ids=_pad([row.output_ids for row in rows], device) if use_penalties else None,
            bias_rows=ints([b[0] for b in bias]) if bias else None,
            bias_ids=ints([b[1] for b in bias]) if bias else None,
            bias_values=floats([b[2] for b in bias]) if bias else None,
            all_greedy=all(greedy),
            use_top_k=any(not g and k < vocab_size for g, k in zip(greedy, top_k)),
            use_top_p=any(not g and p.top_p < 1 for g, p in zip(greedy, params)),
            use_min_p=any(not g and p.min_p > 0 for g, p in zip(greedy, params)),
            use_penalties=use_penalties,
            want_logprobs=any(p.logprobs or p.top_logprobs > 0 for p in params),
            max_top_logprobs=max((p.top_logprobs for p in params), default=0),
        )


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: torch.Tensor  # i64 [B]
    logprobs: torch.Tensor | None  # f32 [B]: the chosen tokens' raw logprobs, when any row asked
    top_ids: torch.Tensor | None  # i64 [B, K]: K = the largest top_logprobs in the batch; row i
    top_logprobs: torch.Tensor | None  # f32 [B, K]   uses its first top_logprobs columns


def _to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    # Non-blocking: a blocking host-to-device copy waits for everything queued on the stream, and
    # with overlapped steps that is the next step's forward, which the host should not wait for.
    return t.to(device, non_blocking=True)


def _pad(sequences: Sequence[Sequence[int]], device: torch.device | str) -> torch.Tensor:
    width = max((len(s) for s in sequences), default=0)
    padded = torch.full((len(sequences), width), -1, dtype=torch.int64)
    for i, seq in enumerate(sequences):
        padded[i, :len(seq)] = torch.as_tensor(list(seq), dtype=torch.int64)
    return _to_device(padded, device)


def token_counts(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """How often each vocab id occurs in each row of ``ids`` ([B, L], -1 = padding); f32 [B, V]."""
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.float32, device=ids.device)
    # Padding goes to an extra column that is dropped, so no row needs a mask.
    slots = torch.where(ids < 0, vocab_size, ids)
    counts.scatter_add_(1, slots, torch.ones_like(slots, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    vocab_size = logits.shape[1]
    assert batch.prompt_ids is not None and batch.output_ids is not None, "pack() builds histories with penalties"
    output_counts = token_counts(batch.output_ids, vocab_size)
    seen = (token_counts(batch.prompt_ids, vocab_size) > 0) | (output_counts > 0)
    repetition = batch.repetition_penalty[:, None]
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    return (logits - batch.frequency_penalty[:, None] * output_counts
            - batch.presence_penalty[:, None] * (output_counts > 0).float())


def masked_argmax(logits: torch.Tensor, bitmask: torch.Tensor, kernels: SamplerKernels) -> torch.Tensor:
    """Greedy tokens under a packed grammar bitmask: what ``sample`` gives rows that only ask for
    greedy and a grammar, in one kernel and with no host round trip (an overlapped step's tokens)."""
    return kernels.argmax_rows(logits, bitmask=bitmask)


def adjusted_scores(raw: torch.Tensor, batch: SamplingBatch, allowed_mask: torch.Tensor | None,
                    kernels: SamplerKernels) -> torch.Tensor:
    """A copy of f32 ``raw`` logits with what ``sample`` applies before choosing: the penalties,
    ``logit_bias`` and ``allowed_mask`` (-inf where not allowed)."""
    scores = apply_penalties(raw, batch) if batch.use_penalties else raw.clone()
    if batch.bias_rows is not None:
        scores.index_put_((batch.bias_rows, batch.bias_ids), batch.bias_values, accumulate=True)
    if allowed_mask is not None:
        if allowed_mask.dtype == torch.bool:
            scores.masked_fill_(~allowed_mask, -math.inf)
        else:
            kernels.apply_bitmask(scores, allowed_mask)
    return scores


def sample(logits: torch.Tensor, batch: SamplingBatch, allowed_mask: torch.Tensor | None,
           kernels: SamplerKernels) -> SamplerOutput:
    """Choose each row's next token. ``allowed_mask`` (bool [B, V], or a packed int32 bitmask in the
    layout of ``bitmask.py``) limits the choice; rows without a constraint should allow every token.
    A row whose mask allows nothing gets token 0."""
    raw = logits.float()
    raw_logprobs = torch.log_softmax(raw, dim=-1) if batch.want_logprobs else None
    scores = adjusted_scores(raw, batch, allowed_mask, kernels)
    tokens = kernels.argmax_rows(scores)
    if not batch.all_greedy:
        # One Triton kernel on a GPU (no sort of the vocabulary), the torch reference elsewhere.
        sampled = kernels.sample_rows(scores, batch.temperature, batch.top_k, batch.top_p, batch.min_p,
                                      batch.seeds, batch.steps, batch.use_top_k, batch.use_top_p, batch.use_min_p)
        tokens = torch.where(batch.greedy, tokens, sampled)
    if raw_logprobs is None:
        return SamplerOutput(tokens, None, None, None)
    chosen = raw_logprobs.gather(1, tokens[:, None]).squeeze(1)
    if batch.max_top_logprobs == 0:
        return SamplerOutput(tokens, chosen, None, None)
    top = raw_logprobs.topk(batch.max_top_logprobs, dim=-1)
    return SamplerOutput(tokens, chosen, top.indices, top.values)
