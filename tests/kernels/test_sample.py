"""Triton sampling against the torch reference, token for token: each filter alone and together, per-row
parameters, edge values (k = 1, k >= V, p = 1, tiny p), masked scores, ties at the cuts, rows split
into many chunks with short candidate lists, and the noise stream's dependence on seed and step."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels import KernelConfig, impl_for_device, triton_support
from kiln.kernels.config import DEFAULTS
from kiln.kernels.sample import ref_sample_rows, triton_sample_rows

# NumPy (the interpreter) warns where the kernel means it: log(min_p = 0) = -inf keeps every token,
# and a row with every score -inf computes -inf - -inf in values it then never keeps.
pytestmark = [pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")]

FEATURES = {  # (use_top_k, use_top_p, use_min_p)
    "temperature": (False, False, False),
    "top_k": (True, False, False),
    "top_p": (False, True, False),
    "min_p": (False, False, True),
    "all": (True, True, True),
}


def random_params(rows: int, vocab: int, device: str) -> dict[str, torch.Tensor]:
    """Per-row parameters as ``SamplingBatch`` holds them, every third row taking each stage's edge
    values: k = 1 and k = V (off), p = 1 (off) and a p so small only the first token passes, min_p = 0."""
    which = torch.arange(rows) % 3
    top_k = torch.where(which == 1, 1, torch.where(which == 2, vocab, torch.randint(1, vocab + 1, (rows,))))
    top_p = torch.where(which == 1, 1.0, torch.where(which == 2, 1e-6, torch.rand(rows) * 0.95))
    params = dict(temperature=torch.rand(rows) * 1.5 + 0.1, top_k=top_k, top_p=top_p,
                  min_p=torch.where(which == 0, 0.0, torch.rand(rows) * 0.3),
                  seeds=torch.randint(-2 ** 63, 2 ** 63 - 1, (rows,), dtype=torch.int64),
                  steps=torch.randint(0, 10_000, (rows,)))
    return {name: t.to(device) for name, t in params.items()}


def check(scores: torch.Tensor, params: dict[str, torch.Tensor], flags: tuple[bool, bool, bool],
          config: KernelConfig = DEFAULTS) -> torch.Tensor:
    got = triton_sample_rows(scores, *params.values(), *flags, config=config)
    want = ref_sample_rows(scores, *params.values(), *flags)
    assert got.dtype == torch.int64
    assert got.tolist() == want.tolist()
    return got


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 5), (7, 100), (3, 1000), (1, 4099)])
def test_matches_reference(rows, vocab, feature, device):
    check(torch.randn(rows, vocab, device=device) * 3, random_params(rows, vocab, device), FEATURES[feature])


@pytest.mark.parametrize("feature", ["top_k", "top_p", "all"])
def test_many_draws_of_one_row(feature, device):
    # One row under 32 seeds: the draws spread over the tokens the filters keep, so a token kept or
    # dropped by mistake at a cut shows as a different draw.
    rows, vocab = 32, 200
    params = random_params(rows, vocab, device)
    params.update(top_k=torch.full((rows,), 40, device=device), top_p=torch.full((rows,), 0.7, device=device),
                  min_p=torch.full((rows,), 0.05, device=device), temperature=torch.full((rows,), 1.2, device=device))
    tokens = check(torch.randn(1, vocab, device=device).expand(rows, -1) * 2, params, FEATURES[feature])
    assert len(set(tokens.tolist())) > 5


@pytest.mark.parametrize("feature", ["top_k", "top_p", "all"])
def test_ties_at_the_cuts(feature, device):
    # Small integers: the k-th score and the top-p cut sit in runs of equal scores, which the
    # reference's stable sort splits by id. Blocks of 16 make the runs span loop steps.
    rows, vocab = 12, 120
    params = random_params(rows, vocab, device)
    params["temperature"] = torch.ones(rows, device=device)
    params["top_k"] = torch.randint(1, 40, (rows,), device=device)
    check(torch.randint(-4, 4, (rows, vocab), device=device).float(), params, FEATURES[feature],
          KernelConfig(sample_block=16))


def test_masked_scores(device):
    # Grammar masks: most ids -inf, one allowed id, none (token 0, as the reference's argmax gives),
    # and k larger than the allowed ids (the cut falls among the -inf).
    rows, vocab = 6, 500
    scores = torch.randn(rows, vocab, device=device) * 3
    scores.masked_fill_(torch.rand(rows, vocab, device=device) < 0.95, float("-inf"))
    scores[1] = float("-inf")
    scores[1, 321] = 0.5
    scores[2] = float("-inf")
    params = random_params(rows, vocab, device)
    params["top_k"][3] = 100
    tokens = check(scores, params, FEATURES["all"])
    assert tokens[1] == 321 and tokens[2] == 0
    check(scores, params, FEATURES["temperature"])


# Chunks of 48 ids in steps of 16 and candidate lists of 24: rows of a few hundred ids take many
# programs, and the cut search copies its list more than once.
SPLIT_SMALL = KernelConfig(sample_chunk=48, sample_block=16, sample_candidates=24)


def check_split(scores: torch.Tensor, params: dict[str, torch.Tensor], flags: tuple[bool, bool, bool]) -> torch.Tensor:
    """``check`` in ``SPLIT_SMALL`` chunks, and the semaphore counters both launches take tickets from
    are back at zero."""
    tokens = check(scores, params, flags, SPLIT_SMALL)
    counters = triton_support._counters.get(scores.device)
    assert counters is None or not counters.any(), "sampling left semaphore counters non-zero"
    return tokens


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("rows,vocab", [(1, 47), (4, 333), (2, 1001)])
def test_rows_split_into_chunks(rows, vocab, feature, device):
    # Vocabularies that end in a partial chunk and step (or fit in one), each row its own parameters.
    check_split(torch.randn(rows, vocab, device=device) * 3, random_params(rows, vocab, device), FEATURES[feature])


@pytest.mark.parametrize("feature", ["top_k", "top_p", "all"])
def test_ties_across_chunks(feature, device):
    # Six values over 250 ids: each run of equal scores spreads over all six chunks, so the cuts' kept
    # ties start in one chunk and end in another.
    rows, vocab = 8, 250
    params = random_params(rows, vocab, device)
    params["temperature"] = torch.ones(rows, device=device)
    params["top_k"] = torch.randint(1, vocab // 2, (rows,), device=device)
    check_split(torch.randint(-3, 3, (rows, vocab), device=device).float(), params, FEATURES[feature])


@pytest.mark.parametrize("feature,kept", [("top_k", range(40, 50)), ("top_p", range(40, 47)), ("all", range(40, 44))])
def test_kept_ties_end_past_a_chunk_boundary(feature, kept, device):
    # Ids 40-59 tie far above the rest, across the boundary at 48. Top-k 10 keeps 40-49; top-p 0.3
    # alone keeps ties while the mass before them (rank * 0.0499) is below 0.3, 40-46; with top-k
    # each tie is 0.1 of Z and top-p 0.35 keeps 40-43. Every seed's draw must fall among those.
    rows, vocab = 16, 150
    scores = torch.zeros(rows, vocab, device=device)
    scores[:, 40:60] = 8.0
    params = random_params(rows, vocab, device)
    params.update(temperature=torch.ones(rows, device=device), top_k=torch.full((rows,), 10, device=device),
                  top_p=torch.full((rows,), 0.3 if feature == "top_p" else 0.35, device=device),
                  min_p=torch.full((rows,), 0.05, device=device))
    tokens = check_split(scores, params, FEATURES[feature]).tolist()
    assert set(tokens) <= set(kept) and len(set(tokens)) > 2


@pytest.mark.parametrize("feature", FEATURES)
def test_one_live_chunk(feature, device):
    # Grammar-like rows whose allowed ids all lie in one chunk (a different one each, the last one
    # partial) and a row allowing nothing, which gives token 0.
    rows, vocab = 5, 230
    scores = torch.full((rows, vocab), float("-inf"), device=device)
    starts = [0, 48, 96, 192]
    for row, start in enumerate(starts):
        scores[row, start:start + 48] = torch.randn(min(48, vocab - start), device=device) * 3
    params = random_params(rows, vocab, device)
    params["top_k"][:2] = 100  # more than the allowed ids: the cut falls among the -inf
    tokens = check_split(scores, params, FEATURES[feature]).tolist()
    assert all(start <= token < start + 48 for token, start in zip(tokens, starts)) and tokens[4] == 0


def test_rows_with_neutral_parameters_ignore_the_stages(device):
    # With every stage on, rows whose k = V, p = 1 and min_p = 0 draw what plain sampling draws.
    rows, vocab = 3, 700
    scores = torch.randn(rows, vocab, device=device)
    params = random_params(rows, vocab, device)
    params.update(top_k=torch.full((rows,), vocab, device=device), top_p=torch.ones(rows, device=device),
                  min_p=torch.zeros(rows, device=device))
    assert check(scores, params, FEATURES["all"]).tolist() == check(scores, params, FEATURES["temperature"]).tolist()


def test_seed_and_step_select_the_stream(device):
    # Flat scores: the draw is the noise's argmax. The same (seed, step) repeats it; other steps move it.
    vocab = 1000
    params = random_params(1, vocab, device)
    params["seeds"].fill_(1234)
    scores = torch.zeros(1, vocab, device=device)
    first = check(scores, params, FEATURES["temperature"]).item()
    assert check(scores, params, FEATURES["temperature"]).item() == first
    draws = set()
    for step in range(12):
        params["steps"].fill_(step)
        draws.add(check(scores, params, FEATURES["temperature"]).item())
    assert len(draws) > 8


def test_dispatch_and_empty_batch(device):
    scores = torch.randn(2, 50, device=device)
    params = random_params(2, 50, device)
    sample_rows = impl_for_device("sample_rows", scores.device).fn
    assert sample_rows is (triton_sample_rows if scores.is_cuda else ref_sample_rows)
    assert sample_rows(scores, *params.values(), *FEATURES["all"]).tolist() == \
        ref_sample_rows(scores, *params.values(), *FEATURES["all"]).tolist()
    assert triton_sample_rows(scores[:0], *(t[:0] for t in params.values()), *FEATURES["all"]).shape == (0,)


def test_rejects_bad_inputs(device):
    scores = torch.randn(2, 10, device=device)
    params = random_params(2, 10, device)
    with pytest.raises(ValueError, match="must be f32"):
        triton_sample_rows(scores.half(), *params.values(), *FEATURES["all"])
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        triton_sample_rows(scores.t(), *params.values(), *FEATURES["all"])
    with pytest.raises(ValueError, match="seeds must be contiguous torch.int64"):
        triton_sample_rows(scores, *{**params, "seeds": params["seeds"].int()}.values(), *FEATURES["all"])
    with pytest.raises(ValueError, match="top_p must be contiguous torch.float32 \\[2\\]"):
        triton_sample_rows(scores, *{**params, "top_p": params["top_p"][:1]}.values(), *FEATURES["all"])


# --- the GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [49152, 128256])
@pytest.mark.parametrize("feature", FEATURES)
def test_decode_shapes(vocab, feature, device):
    # A decode batch's shape, logits spread like a model's, some rows grammar-masked. Top-p sums in
    # another order than torch's cumsum, so a draw may differ when the token at the cut wins, with a
    # probability of ~1e-5 a row.
    rows = 64
    scores = torch.randn(rows, vocab, device=device) * 4
    scores[::8].masked_fill_(torch.rand(rows // 8, vocab, device=device) < 0.9, float("-inf"))
    params = random_params(rows, vocab, device)
    params["top_k"][::3] = torch.randint(1, 200, (len(range(0, rows, 3)),), device=device)
    check(scores, params, FEATURES[feature])


@pytest.mark.gpu
def test_replays_in_a_cuda_graph(device):
    # Captured once, replayed with new scores and the step advanced in place, as the decode graph does.
    rows, vocab = 16, 49152
    scores = torch.randn(rows, vocab, device=device)
    params = random_params(rows, vocab, device)
    triton_sample_rows(scores, *params.values(), *FEATURES["all"])  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_sample_rows(scores, *params.values(), *FEATURES["all"])
    for replay in range(20):
        scores.normal_()
        params["steps"] += 1
        graph.replay()
        assert torch.equal(out, ref_sample_rows(scores, *params.values(), *FEATURES["all"])), f"replay {replay}"
