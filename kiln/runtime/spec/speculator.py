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
from .verify import accept, row_choices

if TYPE_CHECKING:
    from ..engine_core import EngineCore

# Per sample, in request.extras: [verify steps it took part in, tokens those steps gave it].
SPEC_COUNTS = "spec"


class Speculator:
    def __init__(self, config: SpecConfig, core: "EngineCore") -> None:
        self.config = config
        self.core = core
        self.drafter = NgramDrafter(config.ngram_min_window, config.ngram_max_window, config.num_draft_tokens)
        # EAGLE: a draft head proposes instead (and reads the target's features after every step).
        self.eagle = EagleDrafter(config.draft_model_path, core) if config.algorithm in DRAFT_HEADS else None
        bounds = core.artifact.runtime["symbol_bounds"]
        self._max_tokens, self._max_rows = bounds["T"], bounds["N"]
        # Totals over all verify steps (a decoding request in a step counts once), and the last step's mean.
        self.verify_steps = 0
        self.verify_tokens = 0
        self.drafted_tokens = 0
        self.last_accept_length = 0.0

    def step(self, batch: ScheduleBatch) -> list[SampleEvent]:
        core = self.core
        drafts, masks = self._drafts(batch)
        lists = build_verify_lists(batch, drafts, core.page_size)
        outputs = core.worker.forward(lists).outputs
        logits = outputs["logits"]
        core.scheduler.complete_step(batch)
        # Each request's first logits row and drafts: the decoding requests', then the prefill chunks'
        # that reached their prompt's end (one row, no draft).
        plan: list[tuple[Request, int, list[int]]] = []
        row = 0
        for request, draft in zip(batch.decodes, drafts):
            plan.append((request, row, draft))
            row += 1 + len(draft)
        plan.extend((request, first, []) for first, request in enumerate(lists.requests[row:], start=row))
        choices = row_choices(logits, self._sampling_batch(plan, logits.device),
                              self._mask(plan, masks, len(lists.requests), logits.device),
                              [draft[i] if i < len(draft) else -1 for _, _, draft in plan for i in range(len(draft) + 1)],
                              core.runner.sampler_kernels)
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) \
            if any(r.params.logprobs or r.params.top_logprobs for r, _, _ in plan) else None
        events: list[SampleEvent] = []
        step_tokens = 0
        # Each sequence's token rows whose target features the draft head reads: a decoding request's
        # last token and accepted drafts, a prefill chunk's tokens.
        kept_rows = [(request, 0) for request in batch.decodes] + \
            [(chunk.request, chunk.end - chunk.start) for chunk in batch.chunks]
        for index, (request, first, draft) in enumerate(plan):
            if request.done:
                continue
            accepted, tokens = accept(choices, first, draft)
            if index < len(batch.decodes):
                kept_rows[index] = (request, accepted + 1)
            kept, reason = [], None
            for token in tokens:
                request.output_ids.append(token)
                kept.append(token)
                reason = finish_reason(request, token)
                if reason is not None:
                    break
            if index < len(batch.decodes):
                core.scheduler.complete_verify(request, accepted)
                counts = request.extras.setdefault(SPEC_COUNTS, [0, 0])
                counts[0] += 1
                counts[1] += len(kept)
                step_tokens += len(kept)
            logprobs = _logprobs(request, raw_logprobs, first, kept) if raw_logprobs is not None else ()
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
        self.drafted_tokens += sum(map(len, drafts))
        self.last_accept_length = step_tokens / len(batch.decodes)
        return events

    def absorb_prefill(self, batch: ScheduleBatch, lists: StepLists, outputs: dict[str, torch.Tensor]) -> None:
        """After a step without decoding requests (run by the engine core): the draft head reads its
        prefill chunks' target features."""
        if self.eagle is not None:
            self.eagle.absorb(lists, outputs, [(chunk.request, chunk.end - chunk.start) for chunk in batch.chunks])

    def stats(self) -> dict[str, float]:
        """For ``EngineCore.stats``: verify steps, the tokens they gave, and accepted lengths."""
        return {"spec_verify_steps": self.verify_steps, "spec_verify_tokens": self.verify_tokens,
                "spec_drafted_tokens": self.drafted_tokens,
                "spec_accepted_drafts": self.verify_tokens - self.verify_steps,
                "spec_accept_length": self.last_accept_length,
                "spec_mean_accept_length": self.verify_tokens / self.verify_steps if self.verify_steps else 0.0}

    # ---- drafts ---------------------------------------------------------------------------------

    def _drafts(self, batch: ScheduleBatch) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Each decoding request's draft, cut to what can be used (see the module docstring), and
        the grammar mask rows of its positions (None when unconstrained)."""
        tokens = len(batch.decodes) + sum(c.end - c.start for c in batch.chunks)
        rows = len(batch.decodes) + sum(c.wants_logits for c in batch.chunks)
        room = min(self._max_tokens - tokens, self._max_rows - rows)
        graphs = self.core.runner.verify_graphs
        pad = graphs is not None and not batch.chunks and len(batch.decodes) <= graphs.max_batch
        drafts, masks = [], []
        proposals = self._eagle_proposals(batch.decodes, room) if self.eagle is not None else None
        for index, request in enumerate(batch.decodes):
            rules = request.extras[STOP_RULES]
            limit = min(room, rules.max_output - len(request.output_ids) - 1)
            if proposals is not None:
                draft = proposals[index][:max(limit, 0)]
            else:
                draft = self.drafter.propose(request.all_ids, limit) if limit > 0 else []
            if pad:
                draft = self._padded(request, draft, room)
            mask = None
            state = request.extras.get(GRAMMAR)
            if state is not None:
                draft, mask = _grammar_checked(state, draft, self.core.vocab_size)
            draft = draft[:self.core.scheduler.reserve_drafts(request, len(draft))]
            room -= len(draft)
            drafts.append(draft)
            masks.append(None if mask is None else mask[:len(draft) + 1])
        return drafts, masks

    def _eagle_proposals(self, requests: list[Request], room: int) -> list[list[int]]:
        """The draft head's chains, each as long as its request's output budget, the step's room and
        the pages reserved for it allow (reserved first: the chain writes the draft KV of those slots)."""
        lengths = []
        for request in requests:
            budget = request.extras[STOP_RULES].max_output - len(request.output_ids) - 1
            limit = min(room, budget, self.config.num_draft_tokens)
            reserved = self.core.scheduler.reserve_drafts(request, limit) if limit > 0 else 0
            room -= reserved
            lengths.append(reserved)
        return self.eagle.propose(requests, lengths)

    def _padded(self, request: Request, draft: list[int], room: int) -> list[int]:
        """The draft filled to a full chain with repeats of its last token, so that the step brings
        the same number of tokens for every request and runs as a verify graph (``DecodeGraphs`` of
        ``tokens_per_verify`` tokens a sequence). The filler is just more proposals: verification is
        lossless whatever is proposed, and tokens past the output budget are cut by the stop rules;
        only the context's end bounds it (the drafts' positions must exist)."""
        size = min(self.config.num_draft_tokens, room, self.core.max_seq_len - request.num_computed - 1)
        filler = draft[-1] if draft else (request.output_ids or request.prompt_ids)[-1]
        return draft + [filler] * (size - len(draft))

    # ---- the target's choices -----------------------------------------------------------------

    def _sampling_batch(self, plan: list[tuple[Request, int, list[int]]], device: torch.device) -> SamplingBatch:
        """A row per logits row: position ``i`` of a request's chain is its output token
        ``len(output) + i``, its history the output with the first ``i`` drafts appended."""
        rows = []
        for request, _, draft in plan:
            params, step = request.params, len(request.output_ids)
            penalized = params.repetition_penalty != 1 or params.frequency_penalty or params.presence_penalty
            for i in range(len(draft) + 1):
                history = request.output_ids + draft[:i] if penalized else ()
                rows.append(SamplingRow(params, request.seed, step + i, request.prompt_ids if penalized else (),
                                        history))
        return SamplingBatch.pack(rows, self.core.vocab_size, device)

    def _mask(self, plan: list[tuple[Request, int, list[int]]], masks: list[torch.Tensor | None], num_rows: int,
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


def _grammar_checked(state, draft: list[int], vocab_size: int) -> tuple[list[int], torch.Tensor]:
    """The draft cut before the first token the grammar does not allow (or after one that ends it),
    and the mask rows of its positions; the state is left as it was."""
    bitmask = allocate_bitmask(len(draft) + 1, vocab_size)
    walked = 0
    for i in range(len(draft) + 1):
        state.fill_bitmask(bitmask, i)
        if i == len(draft):
            break
        token = draft[i]
        if not (int(bitmask[i, token >> 5]) >> (token & 31)) & 1 or not state.accept(token):
            draft = draft[:i]
            break
        walked += 1
        if state.is_terminated():
            draft = draft[:i + 1]  # the request ends at this token: the row after it is never used
            break
    state.rollback(walked)
    return draft, bitmask


def _logprobs(request: Request, raw_logprobs: torch.Tensor, first: int, tokens: list[int]) -> tuple[TokenLogprob, ...]:
    """Each emitted token's logprob (the raw model distribution at its position, as ``sample``
    reports) and top alternatives, when the request asked."""
    k = request.params.top_logprobs
    if not (request.params.logprobs or k):
        return ()
    rows = raw_logprobs[first:first + len(tokens)]
    chosen = rows.gather(1, torch.tensor(tokens, device=rows.device)[:, None]).squeeze(1).tolist()
    top = rows.topk(k, dim=-1) if k else None
    top_ids = top.indices.tolist() if top is not None else None
    top_values = top.values.tolist() if top is not None else None
    return tuple(TokenLogprob(token, chosen[i], tuple(zip(top_ids[i], top_values[i])) if k else ())
                 for i, token in enumerate(tokens))
