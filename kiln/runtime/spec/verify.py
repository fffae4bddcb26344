"""Verification: which drafts the target accepts, and the token it adds, from one step's logits.

A request that brought its last token ``x`` and drafts ``d1..dm`` has ``m + 1`` logits rows: row ``i``
is the target's next-token logits after ``x, d1..di``. Each row is first made what non-speculative
decoding would sample from at that point: penalties over the history with ``d1..di`` appended,
``logit_bias``, the grammar mask of the state after ``d1..di`` (``SamplingRow``s and mask rows per
position, from the caller), then temperature, top-k, top-p and min-p (``ref_filtered_scores``: the
sampler's own distribution, ``p_i``). Then, position by position:

- greedy rows: ``di+1`` is accepted while it equals the argmax of row ``i`` (ties: lowest id, as
  the sampler); the first row whose argmax differs, or the last row, gives its argmax as the extra
  token. The output is exactly non-speculative greedy decoding's.
- sampled rows, rejection sampling for a deterministic proposal (n-gram drafts propose ``d`` with
  probability 1, so the general rule's ``min(1, p(d) / q(d))`` is ``p(d)``): draft ``d = di+1`` is
  accepted with probability ``p_i(d)``; if rejected, the extra token is drawn from ``p_i`` with ``d``
  removed and renormalized, ``p_i(t) / (1 - p_i(d))`` for ``t != d``, and the chain stops; when every
  draft is accepted the extra token is drawn from the last row's ``p_m``. Each emitted token is then
  distributed as ``p_i``: ``P(d) = p(d)`` and ``P(t) = (1 - p(d)) * p(t) / (1 - p(d)) = p(t)``, so the
  output's distribution is the target's, whatever the drafts.

The random numbers are the sampler's counter-based ones (``kiln.kernels.rng``), keyed by the row's
seed and step: the draws are the Gumbel-max noise of vocabulary ids ``0..V-1`` (a row without a draft
draws exactly the token ``sample`` would), the acceptance coin the uniform of id ``V``, independent of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kiln.kernels import rng
from kiln.kernels.sample import ref_filtered_scores

from ..sampling import SamplerKernels, SamplingBatch
from ..sampling.sampler import adjusted_scores


@dataclass(frozen=True)
class RowChoices:
    """Per logits row (host lists): what the target picks there."""

    greedy: list[bool]
    argmax: list[int]         # the adjusted scores' argmax (greedy rows' token)
    draft_prob: list[float]   # p_i(the row's next draft); 0 where the row has none
    coin: list[float]         # the uniform the acceptance of that draft is decided by
    residual: list[int]       # a draw from p_i without the next draft
    draw: list[int]           # a draw from p_i


def row_choices(logits: torch.Tensor, batch: SamplingBatch, mask: torch.Tensor | None, next_drafts: list[int],
                kernels: SamplerKernels) -> RowChoices:
    """The targets of every logits row; ``next_drafts[r]`` is the draft that row verifies (-1: none)."""
    scores = adjusted_scores(logits.float(), batch, mask, kernels)
    argmax = kernels.argmax_rows(scores).tolist()
    rows = len(next_drafts)
    greedy = batch.greedy.tolist()
    if batch.all_greedy:
        return RowChoices(greedy, argmax, [0.0] * rows, [1.0] * rows, argmax, argmax)
    vocab = scores.shape[1]
    filtered = ref_filtered_scores(scores, batch.temperature, batch.top_k, batch.top_p, batch.min_p,
                                   batch.use_top_k, batch.use_top_p, batch.use_min_p).double()
    uniform = rng.uniforms(rng.random_bits(batch.seeds, batch.steps, vocab + 1))
    noisy = filtered - torch.log(-torch.log(uniform[:, :vocab]))
    drafts = torch.tensor(next_drafts, dtype=torch.int64, device=scores.device)
    has_draft = drafts >= 0
    index = torch.where(has_draft, drafts, 0)[:, None]
    draft_prob = torch.where(has_draft, filtered.softmax(dim=-1).gather(1, index).squeeze(1), 0.0)
    residual = noisy.scatter(1, index, torch.where(has_draft[:, None], -math.inf, noisy.gather(1, index)))
    return RowChoices(greedy, argmax, draft_prob.tolist(), uniform[:, vocab].tolist(),
                      residual.argmax(dim=-1).tolist(), noisy.argmax(dim=-1).tolist())


def accept(choices: RowChoices, first_row: int, drafts: list[int]) -> tuple[int, list[int]]:
    """(accepted drafts, emitted tokens: the accepted drafts and the target's extra token) of the
    request whose rows start at ``first_row``."""
    greedy = choices.greedy[first_row]
    for i, draft in enumerate(drafts):
        row = first_row + i
        if greedy:
            if choices.argmax[row] != draft:
                return i, drafts[:i] + [choices.argmax[row]]
        elif not choices.coin[row] < choices.draft_prob[row]:
            return i, drafts[:i] + [choices.residual[row]]
    last = first_row + len(drafts)
    return len(drafts), drafts + [choices.argmax[last] if greedy else choices.draw[last]]
