"""The speculative step: drafts for every decoding request, one target step that verifies them all,
and the accepted tokens applied as non-speculative decoding would have produced them.

``EngineCore.step`` hands a scheduled batch with decoding requests here. Each decoding request gets
a draft (``NgramDrafter``), cut to what can be used:
- its output budget (``max_new_tokens``: the step emits at most drafts + 1 tokens) and the step's
  size bounds (the artifact's ``T``/``N``, which prefill chunks in the same step share);
- a grammar's matcher: drafts are walked through it, the chain cut at the first token it does not
  allow, the mask of every position kept, and the matcher rolled back (the accepted tokens are fed
  to it again as they are applied);
- the KV pool: ``Scheduler.reserve_drafts`` gives the drafts' slots pages, without retracting.
The step brings ``[last token] + draft`` per decoding request (``build_verify_lists``; prefill
chunks as usual) and wants every row's logits; ``verify`` decides the accepted prefix and the extra
token. Tokens are then appended one by one through the stop rules, so EOS, stop strings, grammar
ends and ``max_new_tokens`` cut the chain where decoding one token at a time would have stopped;
``Scheduler.complete_verify`` counts the accepted drafts' KV as computed and frees the pages of the
rejected ones. A request with no draft brings one token, as without speculation.

Where the worker has verify graphs (decode buckets on: a GPU) and the step has no prefill chunk,
every draft is filled to ``num_draft_tokens`` so the step is uniform and replays a captured graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kiln.kernels.bitmask import allocate_bitmask
from kiln.step_schema import TREE_MASK

from ..constraints import GRAMMAR
from ..outputs import SampleEvent, TokenLogprob
from ..sampling import SamplingBatch, SamplingRow
from ..scheduler.batch import StepLists, build_verify_lists
from ..scheduler.request import Request
from ..scheduler.scheduler import ScheduleBatch
from ..text.stop_rules import STOP_RULES, finish_reason, matched_stop
from .config import DRAFT_HEADS, SpecConfig
from .eagle import EagleDrafter
from .ngram import NgramDrafter
from .tree import DraftTree
from .verify import accept, argmax_choices, row_choices

if TYPE_CHECKING:
    from ..engine_core import EngineCore

# Per sample, in request.extras: [verify steps it took part in, tokens those steps gave it].
SPEC_COUNTS = "spec"
NO_DRAFT = DraftTree([], [])


class Speculator:
    def __init__(self, config: SpecConfig, core: "EngineCore") -> None:
        self.config = config
        self.core = core
        # Whether the target's attention reads a tree mask (EAGLE artifacts do: every verify step fills it).
        self.tree_masks = TREE_MASK.name in core.artifact.step_schema.names
        if config.eagle_topk > 1 and not self.tree_masks:
            raise ValueError(f"speculative_eagle_topk {config.eagle_topk}: the target artifact was compiled without "
                             "tree attention; compile it with tree_attention=True (Engine and kiln serve do for EAGLE)")
        self.drafter = NgramDrafter(config.ngram_min_window, config.ngram_max_window, config.num_draft_tokens)
        # EAGLE: a draft head proposes instead (and reads the target's features after every step).
        self.eagle = EagleDrafter(config.draft_model_path, core, config.eagle_topk) \
            if config.algorithm in DRAFT_HEADS else None
        bounds = core.artifact.runtime["symbol_bounds"]
        self._max_tokens, self._max_rows = bounds["T"], bounds["N"]
        # Totals over all verify steps (a decoding request in a step counts once), and the last step's mean.
        self.verify_steps = 0
        self.verify_tokens = 0
        self.drafted_tokens = 0
        self.last_accept_length = 0.0

    def step(self, batch: ScheduleBatch) -> list[SampleEvent]:
        core = self.core
        trees, masks = self._drafts(batch)
        lists = build_verify_lists(batch, trees, core.page_size, self.tree_masks)
        result = core.worker.forward(lists)
        outputs, logits = result.outputs, result.logits
        core.scheduler.complete_step(batch)
        # Each request's first logits row (its root's) and draft tree: the decoding requests', then
        # the prefill chunks' that reached their prompt's end (one row, no draft).
        plan: list[tuple[Request, int, DraftTree]] = []
        row = 0
        for request, tree in zip(batch.decodes, trees):
            plan.append((request, row, tree))
            row += 1 + len(tree)
        plan.extend((request, first, NO_DRAFT) for first, request in enumerate(lists.requests[row:], start=row))
        if result.greedy is not None and all(r.params.argmax_of_logits and GRAMMAR not in r.extras for r, _, _ in plan):
            # Every row's pick is its logits' argmax, which the verify graph already took: no scores
            # to adjust and no sampling rows to upload between the step and reading its picks.
            choices = argmax_choices(result.greedy.tolist())
        else:
            row_drafts = [[tree.tokens[n] for n in kids] for _, _, tree in plan for kids in tree.distinct_children()]
            choices = row_choices(logits, self._sampling_batch(plan, logits.device),
                                  self._mask(plan, masks, len(lists.requests), logits.device), row_drafts,
                                  core.runner.sampler_kernels)
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) \
            if any(r.params.logprobs or r.params.top_logprobs for r, _, _ in plan) else None
        events: list[SampleEvent] = []
        step_tokens = 0
        # Each sequence's token rows (from its first) whose target features the draft head reads: a
        # decoding request's last token and accepted path, a prefill chunk's tokens.
        kept_rows = [(request, [0]) for request in batch.decodes] + \
            [(chunk.request, list(range(chunk.end - chunk.start))) for chunk in batch.chunks]
        for index, (request, first, tree) in enumerate(plan):
            if request.done:
                continue
            path, tokens = accept(choices, first, tree)
            if index < len(batch.decodes):
                kept_rows[index] = (request, [0] + [1 + n for n in path])
            kept, reason = [], None
            for token in tokens:
                request.output_ids.append(token)
                kept.append(token)
                reason = finish_reason(request, token)
                if reason is not None:
                    break
            if index < len(batch.decodes):
                self._compact(request, path)
                core.scheduler.complete_verify(request, len(path))
                counts = request.extras.setdefault(SPEC_COUNTS, [0, 0])
                counts[0] += 1
                counts[1] += len(kept)
                step_tokens += len(kept)
            logprobs = _logprobs(request, raw_logprobs, [first] + [first + 1 + n for n in path], kept) \
                if raw_logprobs is not None else ()
            if reason == "error":
                events.extend(core.abort(request.rid, f"the grammar rejected token {kept[-1]}"))
                continue
            if reason is not None:
                core.scheduler.finish(request, reason)
                core.forget_if_done(request.rid)
            verify_ct, verify_tokens = request.extras.get(SPEC_COUNTS, (0, 0))
            events.append(SampleEvent(request.rid, request.index, tuple(kept), logprobs, reason, None,
                                      len(request.prompt_ids), request.cached_tokens, verify_ct, verify_tokens,
                                      matched_stop=matched_stop(request) if reason == "stop" else None))
        if self.eagle is not None:
            self.eagle.absorb(lists, outputs, kept_rows)
        self.verify_steps += len(batch.decodes)
        self.verify_tokens += step_tokens
        self.drafted_tokens += sum(map(len, trees))
        self.last_accept_length = step_tokens / len(batch.decodes)
        return events

    def _compact(self, request: Request, path: list[int]) -> None:
        """Moves the KV of an accepted path whose nodes were not the first ones into place: node
        ``path[d]``'s slot to the slot of the request's position ``d`` past its root (the root's
        counted by ``complete_step``); ``complete_verify`` then frees the rest."""
        if path == list(range(len(path))):
            return
        start, pages, size = request.num_computed, request.pages, self.core.page_size
        slot = lambda index: pages[index // size] * size + index % size  # noqa: E731 (a context index's slot)
        self.core.runner.pool.copy_slots([slot(start + n) for n in path], [slot(start + d) for d in range(len(path))])

    def absorb_prefill(self, batch: ScheduleBatch, lists: StepLists, outputs: dict[str, torch.Tensor]) -> None:
        """After a step without decoding requests (run by the engine core): the draft head reads its
        prefill chunks' target features."""
        if self.eagle is not None:
            self.eagle.absorb(lists, outputs, [(chunk.request, list(range(chunk.end - chunk.start)))
                                               for chunk in batch.chunks])

    def stats(self) -> dict[str, float]:
        """For ``EngineCore.stats``: verify steps, the tokens they gave, and accepted lengths."""
        return {"spec_verify_steps": self.verify_steps, "spec_verify_tokens": self.verify_tokens,
                "spec_drafted_tokens": self.drafted_tokens,
                "spec_accepted_drafts": self.verify_tokens - self.verify_steps,
                "spec_accept_length": self.last_accept_length,
                "spec_mean_accept_length": self.verify_tokens / self.verify_steps if self.verify_steps else 0.0}

    # ---- drafts ---------------------------------------------------------------------------------

    def _drafts(self, batch: ScheduleBatch) -> tuple[list[DraftTree], list[torch.Tensor | None]]:
        """Each decoding request's draft tree, cut to what can be used (see the module docstring),
        and the grammar mask rows of its root and nodes (None when unconstrained)."""
        tokens = len(batch.decodes) + sum(c.end - c.start for c in batch.chunks)
        rows = len(batch.decodes) + sum(c.wants_logits for c in batch.chunks)
        room = min(self._max_tokens - tokens, self._max_rows - rows)
        graphs = self.core.runner.verify_graphs
        pad = graphs is not None and not batch.chunks and len(batch.decodes) <= graphs.max_batch
        trees, masks = [], []
        proposals = self._eagle_proposals(batch.decodes, room) if self.eagle is not None else None
        for index, request in enumerate(batch.decodes):
            rules = request.extras[STOP_RULES]
            limit = min(room, rules.max_output - len(request.output_ids) - 1)
            if proposals is not None:
                tree = proposals[index].cut(room, limit)
            else:
                tree = DraftTree.chain(self.drafter.propose(request.all_ids, limit) if limit > 0 else [])
            if pad:
                tree = self._padded(request, tree, room)
            mask = None
            state = request.extras.get(GRAMMAR)
            if state is not None:
                tree, mask = _grammar_checked(state, tree, self.core.vocab_size)
            tree = tree.cut(self.core.scheduler.reserve_drafts(request, len(tree)), len(tree))
            room -= len(tree)
            trees.append(tree)
            masks.append(None if mask is None else mask[:len(tree) + 1])
        return trees, masks

    def _eagle_proposals(self, requests: list[Request], room: int) -> list[DraftTree]:
        """The draft head's trees (chains at top-k 1), each as large as its request's output budget,
        the step's room and the pages reserved for it allow (reserved first: the draft steps write
        the draft KV of those slots, a tree's expanded nodes side by side)."""
        config = self.config
        lengths = []
        for request in requests:
            budget = request.extras[STOP_RULES].max_output - len(request.output_ids) - 1
            limit = min(room, budget, config.num_draft_tokens)
            slots = max(limit, config.eagle_topk * (config.num_steps - 1)) if limit > 0 else 0
            reserved = self.core.scheduler.reserve_drafts(request, slots) if slots > 0 else 0
            room -= min(reserved, limit)
            lengths.append(reserved)
        if config.eagle_topk == 1:
            return [DraftTree.chain(chain) for chain in self.eagle.propose(requests, lengths)]
        return self.eagle.propose_trees(requests, lengths, config.eagle_topk, config.num_steps, config.num_draft_tokens)

    def _padded(self, request: Request, tree: DraftTree, room: int) -> DraftTree:
        """The draft filled to ``num_draft_tokens`` nodes, so that the step brings the same number
        of tokens for every request and runs as a verify graph (``DecodeGraphs`` of
        ``tokens_per_verify`` tokens a sequence): a chain with repeats of its last token, a tree
        with leaves under its root repeating its first token (verification tries a token once per
        node). The filler is just more proposals: verification is lossless whatever is proposed, and
        tokens past the output budget are cut by the stop rules; only the context's end bounds it
        (the drafts' positions must exist)."""
        size = min(self.config.num_draft_tokens, room, self.core.max_seq_len - request.num_computed - 1)
        filler = tree.tokens[-1] if tree.tokens else (request.output_ids or request.prompt_ids)[-1]
        if tree.is_chain:
            return DraftTree.chain(tree.tokens + [filler] * (size - len(tree)))
        extra = max(size - len(tree), 0)
        return DraftTree(tree.tokens + [tree.tokens[0]] * extra, tree.parents + [-1] * extra)

    # ---- the target's choices -----------------------------------------------------------------

    def _sampling_batch(self, plan: list[tuple[Request, int, DraftTree]], device: torch.device) -> SamplingBatch:
        """A row per logits row: the root's row samples output token ``len(output)``, node ``n``'s
        token ``len(output) + depth(n)`` with the output and ``n``'s path as its history."""
        rows = []
        for request, _, tree in plan:
            params, step = request.params, len(request.output_ids)
            penalized = params.repetition_penalty != 1 or params.frequency_penalty or params.presence_penalty
            prompt = request.prompt_ids if penalized else ()
            rows.append(SamplingRow(params, request.seed, step, prompt, request.output_ids if penalized else ()))
            for node in range(len(tree)):
                path = tree.path(node)
                history = request.output_ids + [tree.tokens[n] for n in path] if penalized else ()
                rows.append(SamplingRow(params, request.seed, step + len(path), prompt, history))
        return SamplingBatch.pack(rows, self.core.vocab_size, device)

    def _mask(self, plan: list[tuple[Request, int, DraftTree]], masks: list[torch.Tensor | None], num_rows: int,
              device: torch.device) -> torch.Tensor | None:
        """The packed grammar bitmask of every row, or None when no request is constrained."""
        constrained = [(request, first, masks[i] if i < len(masks) else None) for i, (request, first, _)
                       in enumerate(plan) if GRAMMAR in request.extras]
        if not constrained:
            return None
        bitmask = allocate_bitmask(num_rows, self.core.vocab_size)
        for request, first, rows in constrained:
            if rows is not None:
                bitmask[first:first + len(rows)] = rows
            else:  # a prefill chunk's one row: the state as it is
                request.extras[GRAMMAR].fill_bitmask(bitmask, first)
        return bitmask.to(device, non_blocking=True)


def _grammar_checked(state, tree: DraftTree, vocab_size: int) -> tuple[DraftTree, torch.Tensor]:
    """The tree without the nodes the grammar does not allow (a node whose token it rejects, and
    everything under it; nothing under a node that ends it), and the mask rows of its root and
    nodes (the state after each one's path), walked depth first; the state is left as it was."""
    children = tree.children()
    bitmask = allocate_bitmask(len(tree) + 1, vocab_size)
    kept: list[int] = []

    def visit(row: int) -> None:  # row 0: the root, 1 + n: node n
        if state.is_terminated():
            return  # the request ends at this node's token: its row is never used
        state.fill_bitmask(bitmask, row)
        for node in children[row]:
            token = tree.tokens[node]
            if (int(bitmask[row, token >> 5]) >> (token & 31)) & 1 and state.accept(token):
                kept.append(node)
                visit(1 + node)
                state.rollback(1)

    visit(0)
    kept.sort()
    return tree.keep(kept), bitmask[[0] + [1 + n for n in kept]]


def _logprobs(request: Request, raw_logprobs: torch.Tensor, path_rows: list[int],
              tokens: list[int]) -> tuple[TokenLogprob, ...]:
    """Each emitted token's logprob (the raw model distribution at its position: the row of the
    accepted path it follows, as ``sample`` reports) and top alternatives, when the request asked."""
    k = request.params.top_logprobs
    if not (request.params.logprobs or k):
        return ()
    rows = raw_logprobs[path_rows[:len(tokens)]]
    chosen = rows.gather(1, torch.tensor(tokens, device=rows.device)[:, None]).squeeze(1).tolist()
    top = rows.topk(k, dim=-1) if k else None
    top_ids = top.indices.tolist() if top is not None else None
    top_values = top.values.tolist() if top is not None else None
    return tuple(TokenLogprob(token, chosen[i], tuple(zip(top_ids[i], top_values[i])) if k else ())
                 for i, token in enumerate(tokens))
