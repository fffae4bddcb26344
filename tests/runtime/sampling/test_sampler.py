"""The batched sampler: greedy and filtered sampling against brute force, seeded reproducibility
across batch layouts, the sampled distribution, penalties, bias, masks, logprobs, and the RNG."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.runtime.sampling import (SamplerKernels, SamplingBatch, SamplingParams, SamplingRow, child_seed, new_seed,
                                   sample)
from kiln.kernels import rng
from kiln.kernels.bitmask import unpack_bitmask
from kiln.runtime.sampling.sampler import apply_penalties, token_counts

V = 64
CPU_KERNELS = SamplerKernels.for_device("cpu")


def rows_for(params: list[SamplingParams], seeds: list[int] | None, step: int, **history) -> list[SamplingRow]:
    seeds = seeds or list(range(len(params)))
    return [SamplingRow(p, seed, step, **history) for p, seed in zip(params, seeds)]


def run(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int] | None = None, step: int = 0,
        allowed_mask: torch.Tensor | None = None, **history):
    batch = SamplingBatch.pack(rows_for(params, seeds, step, **history), logits.shape[1])
    return sample(logits, batch, allowed_mask, CPU_KERNELS)


def random_logits(rows: int, vocab: int = V, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = random_logits(8)
    logits[0, [5, 9]] = 100.0  # a tie
    out = run(logits, [SamplingParams(temperature=0)] * 8)
    assert torch.equal(out.token_ids, logits.argmax(-1)) and out.token_ids[0] == 5
    assert out.logprobs is None and out.top_ids is None


def test_small_temperature_and_top_k_1_equal_greedy():
    logits = random_logits(16)
    greedy = logits.argmax(-1)
    for params in (SamplingParams(temperature=1e-3), SamplingParams(temperature=1.5, top_k=1)):
        for step in range(5):
            assert torch.equal(run(logits, [params] * 16, seeds=list(range(16)), step=step).token_ids, greedy)


def brute_force_allowed(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    """The tokens top-k, top-p and min-p (in that order) keep, in float64, one token at a time."""
    values = (logits.double() / params.temperature).tolist()
    order = sorted(range(len(values)), key=lambda i: (-values[i], i))
    kept = order[:params.top_k] if params.top_k > 0 else order
    weights = [math.exp(values[i] - values[kept[0]]) for i in kept]
    total, mass, top_p_kept = sum(weights), 0.0, []
    for token, weight in zip(kept, weights):
        if mass >= params.top_p:
            break
        top_p_kept.append(token)
        mass += weight / total
    best = max(values[i] for i in top_p_kept)
    return {i for i in top_p_kept if math.exp(values[i] - best) >= params.min_p}


@pytest.mark.parametrize("params", [
    SamplingParams(top_k=5), SamplingParams(top_p=0.5), SamplingParams(top_p=0.9, temperature=0.7),
    SamplingParams(min_p=0.2), SamplingParams(top_k=10, top_p=0.8, min_p=0.05, temperature=1.3),
])
def test_filters_only_pick_what_brute_force_allows(params):
    logits = random_logits(4, seed=1)
    allowed = [brute_force_allowed(logits[i], params) for i in range(4)]
    seen = [set() for _ in range(4)]
    for seed in range(300):
        tokens = run(logits, [params] * 4, seeds=[seed * 4 + i for i in range(4)]).token_ids.tolist()
        for i, token in enumerate(tokens):
            seen[i].add(token)
    for i in range(4):
        assert seen[i] <= allowed[i]
        assert len(seen[i]) > 1 or len(allowed[i]) == 1  # it does sample, not just argmax


def test_seeded_rows_ignore_batch_composition_and_position():
    logits = random_logits(6, seed=2, scale=1.0)
    params = [SamplingParams(temperature=0.9, top_p=0.95), SamplingParams(top_k=20), SamplingParams(),
              SamplingParams(min_p=0.01, temperature=1.5), SamplingParams(temperature=0), SamplingParams()]
    seeds = [11, 22, 33, 44, 55, 66]
    for step in range(4):
        full = run(logits, params, seeds, step=step).token_ids
        permutation = [4, 2, 0, 5, 1, 3]
        shuffled = run(logits[permutation], [params[i] for i in permutation], [seeds[i] for i in permutation],
                       step=step).token_ids
        assert torch.equal(shuffled, full[permutation])
        # Alone, and next to rows that switch on other stages (penalties, masks' absence, logprobs).
        for i in range(6):
            others = [SamplingParams(repetition_penalty=1.3, logprobs=True, top_logprobs=3)]
            mixed = run(torch.cat([logits[4:5], logits[i:i + 1]]), others + [params[i]], [999, seeds[i]], step=step,
                        prompt_ids=[1, 2], output_ids=[3])
            assert mixed.token_ids[1] == full[i]


def test_seeds_and_steps_change_the_sample():
    logits = torch.zeros(1, 1000)
    by_seed = {run(logits, [SamplingParams()], [s]).token_ids.item() for s in range(20)}
    by_step = {run(logits, [SamplingParams()], [7], step=t).token_ids.item() for t in range(20)}
    assert len(by_seed) > 15 and len(by_step) > 15


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.5, top_k=4),
                                    SamplingParams(top_p=0.8)])
def test_empirical_frequencies_match_softmax(params):
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])
    draws = 40_000
    batch_logits = logits.expand(draws, -1).contiguous()
    tokens = run(batch_logits, [params] * draws, seeds=list(range(draws))).token_ids
    counts = torch.bincount(tokens, minlength=8).double()
    values = logits[0].double() / params.temperature
    keep = torch.tensor(sorted(brute_force_allowed(logits[0], params)))
    probs = torch.zeros(8, dtype=torch.float64)
    probs[keep] = torch.softmax(values[keep], 0)
    assert counts[probs == 0].sum() == 0
    expected = probs[probs > 0] * draws
    chi_square = ((counts[probs > 0] - expected) ** 2 / expected).sum().item()
    # 99.9th percentile of chi-square with up to 7 degrees of freedom is 24.3.
    assert chi_square < 24.3, (counts, expected)


def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    params = SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    prompt, output = [0, 1], [2, 2, 4]
    batch = SamplingBatch.pack([SamplingRow(params, 0, 3, prompt, output)], 6)
    penalized = apply_penalties(logits, batch)
    expected = torch.tensor([[2.0 / 2, -1.0 * 2, 0.5 / 2 - 0.5 * 2 - 0.25, 3.0, -2.0 * 2 - 0.5 - 0.25, 1.0]])
    assert torch.allclose(penalized, expected)
    # Token 3 stays the argmax; a strong repetition penalty on it (3 / 4 < 2) lets token 0 win.
    assert run(logits, [params], prompt_ids=prompt, output_ids=output).token_ids.item() == 3
    strong = SamplingParams(temperature=0, repetition_penalty=4.0)
    assert run(logits, [strong], prompt_ids=[3], output_ids=[]).token_ids.item() == 0


def test_penalties_apply_per_row():
    logits = torch.tensor([[1.0, 2.0, 0.0], [1.0, 2.0, 0.0]])
    rows = [SamplingRow(SamplingParams(temperature=0, presence_penalty=2.0), 0, 1, [], [1]),
            SamplingRow(SamplingParams(temperature=0), 0, 1, [], [1])]
    assert sample(logits, SamplingBatch.pack(rows, 3), None, CPU_KERNELS).token_ids.tolist() == [0, 1]


def test_token_counts_ignore_padding():
    ids = torch.tensor([[1, 1, 3, -1], [-1, -1, -1, -1]])
    assert token_counts(ids, 4).tolist() == [[0, 2, 0, 1], [0, 0, 0, 0]]


def test_logit_bias_forces_and_bans():
    logits = random_logits(2)
    worst = logits[0].argmin().item()
    best = logits[1].argmax().item()
    params = [SamplingParams(logit_bias={worst: 100.0}), SamplingParams(temperature=0, logit_bias={best: -100.0})]
    out = run(logits, params)
    assert out.token_ids[0] == worst and out.token_ids[1] != best


def test_allowed_mask_bool_and_bitmask():
    logits = random_logits(3, vocab=70)
    allowed = torch.zeros(3, 70, dtype=torch.bool)
    allowed[0, [3, 40, 69]] = True
    allowed[1, 65] = True
    allowed[2] = True
    words = torch.zeros(3, 3, dtype=torch.int64)
    for row, token in allowed.nonzero().tolist():
        words[row, token // 32] |= 1 << (token % 32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # int32 bit patterns
    assert torch.equal(unpack_bitmask(bitmask, 70), allowed)
    params = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(temperature=0)]
    for seed in range(50):
        for mask in (allowed, bitmask):
            tokens = run(logits, params, seeds=[seed, 0, 0], allowed_mask=mask).token_ids.tolist()
            assert tokens[0] in (3, 40, 69) and tokens[1] == 65 and tokens[2] == logits[2].argmax().item()


def test_logprobs_are_raw_log_softmax():
    logits = random_logits(3)
    params = [SamplingParams(logprobs=True, temperature=0.3, repetition_penalty=1.5, top_k=3),
              SamplingParams(top_logprobs=5), SamplingParams(logprobs=True, top_logprobs=2, temperature=0)]
    out = run(logits, params, prompt_ids=[1, 2, 3], output_ids=[4])
    reference = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(out.logprobs, reference.gather(1, out.token_ids[:, None]).squeeze(1))
    top = reference.topk(5, dim=-1)
    assert out.top_ids.shape == (3, 5)
    assert torch.equal(out.top_ids, top.indices) and torch.allclose(out.top_logprobs, top.values)


def test_rng_matches_exact_splitmix64():
    # splitmix64's published first outputs for state 1234567.
    expected = [6457827717110365317, 3203168211198807973, 9817491932198370423, 4593380528125082431,
                16408922859458223821]
    assert [rng.mix64_int(1234567 + (i + 1) * rng.GOLDEN) for i in range(5)] == expected
    values = torch.randint(-2**63, 2**63 - 1, (1000,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    values = torch.cat([values, torch.tensor([0, -1, 2**63 - 1, -2**63])])
    assert rng.mix64(values).tolist() == [rng.to_int64(rng.mix64_int(v)) for v in values.tolist()]
    seeds, steps = torch.tensor([5, -9]), torch.tensor([0, 17])
    bits = rng.random_bits(seeds, steps, 3)
    for row, (seed, step) in enumerate([(5, 0), (-9, 17)]):
        key = rng.mix64_int(rng.mix64_int(seed) + step)
        assert bits[row].tolist() == [rng.to_int64(rng.mix64_int(key + (v + 1) * rng.GOLDEN)) for v in range(3)]


def test_uniforms_stay_inside_the_open_interval():
    extremes = torch.tensor([0, -1, 2**63 - 1, -2**63], dtype=torch.int64)
    u = rng.uniforms(extremes)
    assert (u > 0).all() and (u < 1).all()
    assert torch.isfinite(-torch.log(-torch.log(u))).all()
    noise = rng.gumbel_noise(torch.arange(100), torch.zeros(100, dtype=torch.int64), 1000)
    assert abs(noise.mean().item() - 0.5772) < 0.01  # the Euler-Mascheroni constant


def test_seeds():
    assert child_seed(42, 0) == 42
    children = {child_seed(42, i) for i in range(10)}
    assert len(children) == 10 and all(-2**63 <= s < 2**63 for s in children)
    assert new_seed() != new_seed()
    assert rng.to_int64(2**64 + 5) == 5 and rng.to_int64(2**63) == -2**63
