"""The EAGLE drafter: a compiled draft head (``models/eagle.py``) run beside the target, proposing
a chain of greedy draft tokens per decoding request.

State per request (``request.extras[EAGLE_PENDING]``): the target's features of the positions the
draft has not read yet, as ``(first position, rows)`` segments, recorded after every target step
(``absorb``: a prefill chunk's tokens, a verify step's accepted ones). The draft head's KV lives in
its own pool, indexed by the target's pages and slots: a draft row at position ``p`` reads token
``p + 1`` with the target's features of position ``p`` and is stored at ``p``'s slot, so the
scheduler's pages, reservations and frees cover it too (pages in the radix cache keep the draft KV
their first request wrote).

``propose`` runs, for all decoding requests at once: one draft step over each request's pending
positions (the catch-up; its last row gives the first draft and the hidden state to continue
from), then ``k - 1`` steps of one token each, a row per request still drafting, each reading the
previous step's token and hidden state. Rows catching up read the target's features, rows
continuing a draft their own hidden state (EAGLE-3: ``target_features`` and ``draft_hidden``, the
other zeroed). The drafts' slots are reserved before the chain writes them.

Only greedy chains (top-k 1); the verify step and its accept rule are the n-gram path's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..artifact import load_artifact
from ..scheduler.batch import StepLists
from ..scheduler.request import Request
from ..worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from ..engine_core import EngineCore

EAGLE_PENDING = "eagle_pending"
# Draft head architecture -> the target's step output it reads.
_TARGET_OUTPUT = {"LlamaForCausalLMEagle": "token_hidden_states", "LlamaForCausalLMEagle3": "aux_hidden_states"}


class EagleDrafter:
    def __init__(self, draft_path: str, core: "EngineCore") -> None:
        artifact = load_artifact(draft_path)
        architecture = artifact.manifest["model"]["architecture"]
        if architecture not in _TARGET_OUTPUT:
            raise ValueError(f"speculative_draft_model_path {draft_path}: a {architecture} artifact, not an EAGLE draft "
                             f"head ({', '.join(_TARGET_OUTPUT)})")
        self.feature = _TARGET_OUTPUT[architecture]
        target_outputs = [o.name for o in core.artifact.step_schema.outputs]
        if self.feature not in target_outputs:
            raise ValueError(f"the target artifact does not return {self.feature}, which this draft head reads; "
                             f"compile it with step_outputs=('{self.feature}',) (Engine does)")
        if artifact.runtime["page_size"] != core.page_size or artifact.runtime["vocab_size"] != core.vocab_size:
            raise ValueError(f"speculative_draft_model_path {draft_path}: page size {artifact.runtime['page_size']} and "
                             f"vocabulary {artifact.runtime['vocab_size']} must be the target's "
                             f"({core.page_size}, {core.vocab_size})")
        self.core = core
        self.eagle3 = architecture == "LlamaForCausalLMEagle3"
        self.runner = ModelRunner(artifact, core.runner.device, core.worker.num_pages)
        config = artifact.manifest["model"]["config"]
        self.hidden_size = int(config["hidden_size"])
        self.feature_size = 3 * int(config.get("target_hidden_size") or self.hidden_size) if self.eagle3 \
            else self.hidden_size

    # ---- the target's features ----------------------------------------------------------------

    def absorb(self, lists: StepLists, outputs: dict[str, torch.Tensor], sequences: list[tuple[Request, int]]) -> None:
        """Records the target features of ``sequences``: (request, rows kept) for sequence ``i`` of
        the step, its first ``rows`` token rows (a verify step keeps the accepted ones)."""
        features = outputs[self.feature]
        for i, (request, rows) in enumerate(sequences):
            if rows <= 0:
                continue
            first_row = lists.q_start[i]
            start = lists.positions[first_row]
            pending = [(s, r[:start - s]) for s, r in request.extras.get(EAGLE_PENDING, []) if s < start]
            if pending and pending[-1][0] + pending[-1][1].shape[0] != start:
                pending = []  # a gap (the target recomputed from elsewhere): only the contiguous run is read
            pending.append((start, features[first_row:first_row + rows].clone()))
            request.extras[EAGLE_PENDING] = pending

    # ---- drafts -------------------------------------------------------------------------------

    def propose(self, requests: list[Request], lengths: list[int]) -> list[list[int]]:
        """Draft chains of up to ``lengths[i]`` tokens (whose slots the caller reserved) for each request."""
        page_size = self.core.page_size
        drafts: list[list[int]] = [[] for _ in requests]
        active = [i for i, (r, n) in enumerate(zip(requests, lengths)) if n > 0 and r.extras.get(EAGLE_PENDING)]
        if not active:
            return drafts
        # The catch-up step: every pending position of each request, the last row's output kept.
        lists, rows = StepLists.empty(), []
        for i in active:
            request = requests[i]
            segments = request.extras.pop(EAGLE_PENDING)
            start = segments[0][0]
            rows.append(torch.cat([r for _, r in segments]))
            count = rows[-1].shape[0]
            ids = request.all_ids
            _append_sequence(lists, request, start, ids[start + 1:start + 1 + count], page_size)
        tokens, hidden = self._run(lists, torch.cat(rows), from_target=True)
        for i, token in zip(active, tokens):
            drafts[i].append(token)
        for step in range(1, max(lengths)):
            keep = [j for j, i in enumerate(active) if lengths[i] > step]
            if not keep:
                break
            lists = StepLists.empty()
            for j in keep:
                request = requests[active[j]]
                _append_sequence(lists, request, request.num_computed + step - 1, [drafts[active[j]][-1]], page_size)
            tokens, hidden = self._run(lists, hidden[keep], from_target=False)
            active = [active[j] for j in keep]
            for i, token in zip(active, tokens):
                drafts[i].append(token)
        return drafts

    def _run(self, lists: StepLists, hidden: torch.Tensor, from_target: bool) -> tuple[list[int], torch.Tensor]:
        """One draft step: each sequence's last row's draft token, and its hidden state (copied)."""
        rows = hidden.shape[0]
        device = self.runner.device
        zeros_hidden = torch.zeros(rows, self.hidden_size, dtype=hidden.dtype, device=device)
        if self.eagle3:
            feeds = {"target_features": hidden if from_target else torch.zeros(rows, self.feature_size,
                                                                              dtype=hidden.dtype, device=device),
                     "draft_hidden": zeros_hidden if from_target else hidden}
        else:
            feeds = {"draft_hidden": hidden}
        out = self.runner.forward_eager(lists, feeds).outputs
        return out["draft_tokens"].tolist(), out["hidden_states"].clone()


def _append_sequence(lists: StepLists, request: Request, start: int, ids: list[int], page_size: int) -> None:
    """A draft step's sequence: ``ids`` at positions from ``start``, the last row's output wanted."""
    pages = request.pages
    lists.q_start.append(len(lists.token_ids))
    lists.q_len.append(len(ids))
    lists.kv_len.append(start + len(ids))
    lists.page_table.append(pages)
    lists.token_ids.extend(ids)
    lists.positions.extend(range(start, start + len(ids)))
    lists.slots.extend(pages[p // page_size] * page_size + p % page_size for p in range(start, start + len(ids)))
    lists.logits_index.append(len(lists.token_ids) - 1)
    lists.requests.append(request)
