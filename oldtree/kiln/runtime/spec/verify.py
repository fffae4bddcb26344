"""Verification: which drafts the target accepts, and the token it adds, from one step's logits.

A request that brought its last token ``x`` and a draft tree (``tree.DraftTree``; a chain ``d1..dm``
is the tree whose node ``i`` follows node ``i - 1``) has a logits row for ``x`` and each node: a
node's row is the target's next-token logits after ``x`` and the node's path. Below, for a chain,
row ``i`` is the row after ``x, d1..di``; in a tree the walk goes from the root's row down the
accepted children's rows, and the drafts a row verifies are its node's children. Each row is first
made what non-speculative decoding would sample from at that point: penalties over the history with ``d1..di`` appended,
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
  output's distribution is the target's, whatever the drafts. A tree node's several children are
  tried in turn (SpecInfer's multi-draft rule for deterministic proposals): child ``c_j`` accepted with
  ``p`` renormalized without ``c_1..c_j-1``, i.e. by one coin landing in ``[p(c_1..c_j-1), p(c_1..c_j))``;
  if every child is rejected the extra token is drawn from ``p`` without them all. Each stage keeps
  the distribution ``p`` (the single-draft argument, applied to each renormalized ``p``).

The random numbers are the sampler's counter-based ones (``kiln.kernels.rng``), keyed by the row's
seed and step: the draws are the Gumbel-max noise of vocabulary ids ``0..V-1`` (a row without a draft
draws exactly the token ``sample`` would), the acceptance coin the uniform of id ``V``, independent of them.
Rows of one depth share their step's numbers; a walk reads one row per depth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kiln.kernels import rng
from kiln.kernels.sample import ref_filtered_scores

from ..sampling import SamplerKernels, SamplingBatch
from ..sampling.sampler import adjusted_scores
from .tree import DraftTree


@dataclass(frozen=True)
class RowChoices:
    """Per logits row (host lists): what the target picks there."""

    greedy: list[bool]
    argmax: list[int]     # the adjusted scores' argmax (greedy rows' token)
    chosen: list[int]     # sampled rows: which of the row's drafts the coin accepts (-1: none)
    residual: list[int]   # a draw from p_i without the row's drafts
    draw: list[int]       # a draw from p_i


def argmax_choices(argmax: list[int]) -> RowChoices:
    """The targets of rows that are all greedy over their raw logits (``SamplingParams.argmax_of_logits``,
    no grammar), from each row's argmax (a verify graph takes it on the device)."""
    return RowChoices([True] * len(argmax), argmax, [-1] * len(argmax), argmax, argmax)


def row_choices(logits: torch.Tensor, batch: SamplingBatch, mask: torch.Tensor | None, drafts: list[list[int]],
                kernels: SamplerKernels) -> RowChoices:
    """The targets of every logits row; ``drafts[r]``: the distinct draft tokens that row verifies
    (a tree node's children, in order; [] for none)."""
    scores = adjusted_scores(logits.float(), batch, mask, kernels)
    argmax = kernels.argmax_rows(scores).tolist()
    if batch.all_greedy:
        return argmax_choices(argmax)
    rows = len(drafts)
    greedy = batch.greedy.tolist()
    vocab = scores.shape[1]
    filtered = ref_filtered_scores(scores, batch.temperature, batch.top_k, batch.top_p, batch.min_p,
                                   batch.use_top_k, batch.use_top_p, batch.use_min_p).double()
    uniform = rng.uniforms(rng.random_bits(batch.seeds, batch.steps, vocab + 1))
    noisy = filtered - torch.log(-torch.log(uniform[:, :vocab]))
    width = max(1, max(map(len, drafts), default=0))
    padded = torch.tensor([row + [-1] * (width - len(row)) for row in drafts], dtype=torch.int64,
                          device=scores.device)
    valid = padded >= 0
    index = torch.where(valid, padded, 0)
    probs = torch.where(valid, filtered.softmax(dim=-1).gather(1, index), 0.0)
    # One coin per row: draft j is accepted when it falls in [P(d_1..d_j-1), P(d_1..d_j)): draft 1
    # with probability p(d_1), draft j after the ones before it were rejected with p(d_j) / (1 - ...).
    hit = (uniform[:, vocab, None] < probs.cumsum(dim=1)) & valid
    chosen = torch.where(hit.any(dim=1), hit.int().argmax(dim=1), -1)
    excluded = torch.zeros_like(noisy, dtype=torch.int32).scatter_add_(1, index, valid.int()) > 0
    residual = noisy.masked_fill(excluded, -math.inf)
    return RowChoices(greedy, argmax, chosen.tolist(), residual.argmax(dim=-1).tolist(), noisy.argmax(dim=-1).tolist())


def accept(choices: RowChoices, first_row: int, tree: DraftTree) -> tuple[list[int], list[int]]:
    """(the accepted path's nodes, the emitted tokens: their tokens and the target's extra token) of
    the request whose rows start at ``first_row`` (its root's row; node ``i``'s is ``first_row + 1 + i``)."""
    children = tree.distinct_children()
    greedy = choices.greedy[first_row]
    path: list[int] = []
    row = first_row
    while True:
        kids = children[row - first_row]
        if greedy:
            node = next((n for n in kids if tree.tokens[n] == choices.argmax[row]), -1)
        else:
            node = kids[choices.chosen[row]] if choices.chosen[row] >= 0 else -1
        if node < 0:
            extra = choices.argmax[row] if greedy else choices.residual[row] if kids else choices.draw[row]
            return path, [tree.tokens[n] for n in path] + [extra]
        path.append(node)
        row = first_row + 1 + node
