"""The EAGLE drafter: a compiled draft head (``models/eagle.py``) run beside the target, proposing
a chain of greedy draft tokens (top-k 1) or an EAGLE-2 draft tree per decoding request.

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

With decode graphs on (a GPU), the draft steps after the catch-up, of one token a sequence in a
chain and ``topk`` in a tree, replay graphs of the target's decode buckets (``DecodeGraphs`` with the
hidden states as extra inputs, ``graphs``); the catch-up, of any length, runs eagerly.

``propose_trees`` (top-k > 1, ``spec/tree.py``): after the same catch-up, each later draft step
runs the ``topk`` best nodes so far of each request side by side in its reserved slots past the
root (step ``s``'s at context indices ``root + (s - 1) * topk ..``, all at the position of depth
``s``), each seeing the prefix and its own ancestors through the tree mask; its ``topk`` likeliest
children join the candidates with cumulative scores, and the best ``num_nodes`` make the tree. The
next catch-up rewrites the draft KV of the positions the target accepted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kiln.step_schema import TREE_MASK
from kiln.tensors import torch_dtype

from ..artifact import load_artifact
from ..scheduler.batch import StepLists
from ..scheduler.request import Request
from ..worker.decode_graphs import DecodeGraphs
from ..worker.model_runner import ModelRunner
from ..worker.worker import LocalWorker
from .tree import Candidates, DraftTree, mask_bits

if TYPE_CHECKING:
    from ..engine_core import EngineCore

EAGLE_PENDING = "eagle_pending"
# Draft head architecture -> the target's step output it reads.
_TARGET_OUTPUT = {"LlamaForCausalLMEagle": "token_hidden_states", "LlamaForCausalLMEagle3": "aux_hidden_states"}


class EagleDrafter:
    def __init__(self, draft_path: str, core: "EngineCore", topk: int = 1) -> None:
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
        # EAGLE-3's draft vocabulary -> the target's (target id = draft id + d2t[draft id]), for trees'
        # top-k (the graph maps its own argmax); None when the vocabularies are one.
        d2t = self.runner.executor.weights.get("d2t")
        self.d2t = d2t.long() if d2t is not None else None
        bounds = artifact.runtime["symbol_bounds"]
        self._max_rows = min(bounds["T"], bounds["N"])  # a draft step's rows, every one's logits wanted
        if topk > 1:
            if TREE_MASK.name not in artifact.step_schema.names:
                raise ValueError(f"speculative_draft_model_path {draft_path}: the draft artifact was compiled without "
                                 "tree attention, which draft trees (speculative_eagle_topk > 1) need")
            if not isinstance(core.worker, LocalWorker):
                raise ValueError("speculative_eagle_topk > 1 runs on one rank (world_size=1) for now: a verify step "
                                 "moves the accepted path's KV in rank 0's pool")
        # The draft steps after the catch-up (one token a sequence in a chain, top-k nodes in a tree) run
        # as graphs of the target's decode buckets when the target has them; the catch-up stays eager.
        buckets = core.runner.decode_graphs.buckets if core.runner.decode_graphs is not None else []
        self.graphs = self._draft_graphs(buckets, topk, bounds["P"], torch_dtype(artifact.runtime["dtype"]))

    # ---- the target's features ----------------------------------------------------------------

    def absorb(self, lists: StepLists, outputs: dict[str, torch.Tensor],
               sequences: list[tuple[Request, list[int]]]) -> None:
        """Records the target features of ``sequences``: (request, rows kept) for sequence ``i`` of
        the step, its token rows (offsets from its first) at consecutive positions from its first
        token's (a verify step keeps its root and accepted path)."""
        features = outputs[self.feature]
        for i, (request, rows) in enumerate(sequences):
            if not rows:
                continue
            first_row = lists.q_start[i]
            start = lists.positions[first_row]
            pending = [(s, r[:start - s]) for s, r in request.extras.get(EAGLE_PENDING, []) if s < start]
            if pending and pending[-1][0] + pending[-1][1].shape[0] != start:
                pending = []  # a gap (the target recomputed from elsewhere): only the contiguous run is read
            taken = features[first_row:first_row + rows[-1] + 1] if rows == list(range(len(rows))) \
                else features[[first_row + r for r in rows]]
            pending.append((start, taken.clone()))
            request.extras[EAGLE_PENDING] = pending

    # ---- drafts -------------------------------------------------------------------------------

    def propose(self, requests: list[Request], lengths: list[int]) -> list[list[int]]:
        """Draft chains of up to ``lengths[i]`` tokens (whose slots the caller reserved) for each request."""
        page_size = self.core.page_size
        drafts: list[list[int]] = [[] for _ in requests]
        active, out = self._catch_up(requests, lengths)
        if not active:
            return drafts
        tokens, hidden = out["draft_tokens"].tolist(), out["hidden_states"]
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
            out = self._run(lists, hidden[keep], from_target=False)
            tokens, hidden = out["draft_tokens"].tolist(), out["hidden_states"]
            active = [active[j] for j in keep]
            for i, token in zip(active, tokens):
                drafts[i].append(token)
        return drafts

    def propose_trees(self, requests: list[Request], slots: list[int], topk: int, steps: int,
                      num_nodes: int) -> list[DraftTree]:
        """EAGLE-2 draft trees of ``num_nodes`` nodes (``spec/tree.py``): after the catch-up, each
        draft step runs the ``topk`` best nodes so far side by side (in the ``slots[i]`` slots the
        caller reserved past each request's root: as many steps as they hold), each attending to its
        ancestors, and proposes ``topk`` children for each."""
        trees = [DraftTree([], []) for _ in requests]
        active, out = self._catch_up(requests, slots)
        if not active:
            return trees
        candidates = {i: Candidates([], [], []) for i in active}
        beams: dict[int, list[int]] = {}
        beam_hidden: dict[int, torch.Tensor] = {}
        probs, tokens = self._top(out["logits"], topk)
        for j, i in enumerate(active):
            beams[i] = [candidates[i].add(t, p, -1) for t, p in zip(tokens[j], probs[j])]
            beam_hidden[i] = out["hidden_states"][j:j + 1].expand(topk, -1)
        placed: dict[int, dict[int, int]] = {i: {} for i in active}  # candidate -> its context index
        for step in range(1, steps):
            running = [i for i in active if slots[i] >= step * topk]
            for group in _groups(running, max(1, self._max_rows // topk)):
                lists, rows = StepLists.empty(), []
                lists.tree_mask = []
                for i in group:
                    first = requests[i].num_computed + (step - 1) * topk
                    for j, c in enumerate(beams[i]):
                        placed[i][c] = first + j
                    masks = [mask_bits(first + topk, requests[i].num_computed,
                                       [placed[i][a] for a in candidates[i].lineage(c)]) for c in beams[i]]
                    _append_tree_step(lists, requests[i], [candidates[i].tokens[c] for c in beams[i]],
                                      requests[i].num_computed + step - 1, first, masks, self.core.page_size)
                    rows.append(beam_hidden[i])
                out = self._run(lists, torch.cat(rows), from_target=False)
                probs, tokens = self._top(out["logits"], topk)
                for g, i in enumerate(group):
                    cand, row0 = candidates[i], g * topk
                    children = [(cand.add(tokens[row0 + j][k], cand.scores[c] * probs[row0 + j][k], c), row0 + j)
                                for j, c in enumerate(beams[i]) for k in range(topk)]
                    best = sorted(children, key=lambda child: (-cand.scores[child[0]], child[0]))[:topk]
                    beams[i] = [c for c, _ in best]
                    beam_hidden[i] = out["hidden_states"][[row for _, row in best]]
        for i in active:
            trees[i] = candidates[i].select_nodes(num_nodes)
        return trees

    def _catch_up(self, requests: list[Request], lengths: list[int]) -> tuple[list[int], dict[str, torch.Tensor]]:
        """The catch-up step of the requests with drafts to make: every pending position of each,
        the last row's output kept; (their indices, the step's outputs)."""
        active = [i for i, (r, n) in enumerate(zip(requests, lengths)) if n > 0 and r.extras.get(EAGLE_PENDING)]
        if not active:
            return active, {}
        lists, rows = StepLists.empty(), []
        for i in active:
            request = requests[i]
            segments = request.extras.pop(EAGLE_PENDING)
            start = segments[0][0]
            rows.append(torch.cat([r for _, r in segments]))
            count = rows[-1].shape[0]
            ids = request.all_ids
            _append_sequence(lists, request, start, ids[start + 1:start + 1 + count], self.core.page_size)
        return active, self._run(lists, torch.cat(rows), from_target=True)

    def _run(self, lists: StepLists, hidden: torch.Tensor, from_target: bool) -> dict[str, torch.Tensor]:
        """One draft step: each wanted row's logits, draft token and hidden state (copied)."""
        rows = hidden.shape[0]
        device = self.runner.device
        zeros_hidden = torch.zeros(rows, self.hidden_size, dtype=hidden.dtype, device=device)
        if self.eagle3:
            feeds = {"target_features": hidden if from_target else torch.zeros(rows, self.feature_size,
                                                                              dtype=hidden.dtype, device=device),
                     "draft_hidden": zeros_hidden if from_target else hidden}
        else:
            feeds = {"draft_hidden": hidden}
        if not from_target and self.graphs is not None and self.graphs.fits(lists):
            out = self.graphs.run(lists, extra_feeds=feeds).outputs
        else:
            out = self.runner.forward_eager(lists, feeds).outputs
        return {"logits": out["logits"], "draft_tokens": out["draft_tokens"],
                "hidden_states": out["hidden_states"].clone()}

    def _draft_graphs(self, buckets: list[int], k: int, page_table_width: int,
                      dtype: torch.dtype) -> DecodeGraphs | None:
        """Graphs of the draft steps of ``k`` tokens a sequence (a chain's one, a tree's top-k nodes), the
        hidden-state inputs beside the step's."""
        fitting = [b for b in buckets if k * b <= self._max_rows]
        if not fitting:
            return None
        extra = {"draft_hidden": (dtype, self.hidden_size)}
        if self.eagle3:
            extra["target_features"] = (dtype, self.feature_size)
        return DecodeGraphs(self.runner.executor, self.runner.kv_views, fitting, page_table_width,
                            tokens_per_sequence=k, extra_inputs=extra)

    def _top(self, logits: torch.Tensor, topk: int) -> tuple[list[list[float]], list[list[int]]]:
        """Each row's ``topk`` likeliest draft tokens (in the target's vocabulary) and their draft probabilities."""
        top = logits.float().softmax(dim=-1).topk(topk, dim=-1)
        ids = top.indices
        if self.d2t is not None:
            ids = ids + self.d2t[ids]
        return top.values.tolist(), ids.tolist()


def _groups(items: list[int], size: int) -> list[list[int]]:
    return [items[k:k + size] for k in range(0, len(items), size)]


def _append_tree_step(lists: StepLists, request: Request, tokens: list[int], position: int, first: int,
                      masks: list[int], page_size: int) -> None:
    """A tree draft step's sequence: ``tokens`` (nodes of one depth) side by side at context indices
    from ``first``, all at ``position``, each seeing what its mask row says, every row's output wanted."""
    pages = request.pages
    row = len(lists.token_ids)
    lists.q_start.append(row)
    lists.q_len.append(len(tokens))
    lists.kv_len.append(first + len(tokens))
    lists.page_table.append(pages)
    lists.token_ids.extend(tokens)
    lists.positions.extend([position] * len(tokens))
    lists.slots.extend(pages[p // page_size] * page_size + p % page_size for p in range(first, first + len(tokens)))
    lists.logits_index.extend(range(row, row + len(tokens)))
    lists.tree_mask.extend(masks)
    lists.requests.append(request)


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
