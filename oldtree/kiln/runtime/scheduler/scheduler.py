"""The scheduler: which tokens of which requests the next step computes, and where their KV goes.

Data flow, once per step (plain Python; no tensors):

    Request (waiting queue)  --admit: radix match + lock, pages-->  running
    running  --schedule()-->  ScheduleBatch: decoding requests, then
                              [ScheduledChunk(request, start, end, wants_logits)]
    ScheduleBatch  --batch.build_step_lists()-->  index lists for StepInputs (the model runner)
    sampled tokens  --complete_step()-->  num_computed advances; finished prompts enter the radix tree

Each step: every decoding request gets its one token first (growing a page when it crosses a
page boundary; if the pool is short even after evicting unlocked cache entries, the youngest
running requests are **retracted**: their KV goes back, they return to the front of the queue
with their generated tokens and later resume where they were). The rest of the token budget goes to
chunked prefill: requests already prefilling continue, then waiting requests are admitted in
policy order (``fcfs``, or ``lpm``: longest cached prefix first) until the budget, the running cap
or the pool runs out. Prefill chunks and decode tokens share one step (continuous batching).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from ..kvcache.allocator import PageAllocator
from ..kvcache.radix import RadixCache
from .request import DECODING, PREFILLING, Request, RequestState

POLICIES = ("fcfs", "lpm")
# Ordering by cached prefix costs one tree walk per waiting request; past this queue length the
# scheduler falls back to arrival order, as SGLang does.
LPM_MAX_QUEUE = 256
# A waiting request sharing at least this many uncached tokens with one admitted in the same step
# waits for that one's prompt to reach the cache instead of computing the same prefix again.
IN_BATCH_SHARE_TOKENS = 32


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_tokens: int
    max_running: int
    page_size: int
    max_logit_rows: int = 1 << 30   # rows of logits a step returns (the artifact's N bound)
    policy: str = "fcfs"
    enable_prefix_cache: bool = True

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"schedule policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")


class AdapterSlots(Protocol):
    """Device slots for requests' LoRA adapters (``runtime.lora.LoraRegistry``)."""

    def pin(self, entry) -> bool:
        """Makes the adapter resident and pins its slot; False when no slot can take it now."""

    def unpin(self, entry) -> None: ...


class ScheduledChunk(NamedTuple):
    """Tokens ``start..end`` of one request, computed in one step (a NamedTuple: cheaper to build
    than a frozen dataclass)."""

    request: Request
    start: int              # first token (index into request.all_ids) computed this step
    end: int                # one past the last
    wants_logits: bool      # the chunk reaches the end of the request's tokens: sample the next one


@dataclass(frozen=True)
class ScheduleBatch:
    # Decoding requests, each computing one token (its last, this step's input: a decoding request
    # has computed all its tokens but that one) and wanting its logits; their rows lead the step.
    # Requests rather than chunks: every running request is one of these every step.
    decodes: list[Request]
    chunks: list[ScheduledChunk]    # the other requests' chunks (prefill), after the decodes


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, cache: RadixCache,
                 adapters: AdapterSlots | None = None) -> None:
        self.config = config
        self.adapters = adapters
        self.allocator = allocator
        self.cache = cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_retractions = 0

    # ---- requests in and out ----------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: str) -> None:
        """Ends a running request: its computed KV goes to the cache (or back to the pool)."""
        self._release(request, keep_in_cache=True)
        self.running.remove(request)
        request.state = RequestState.FINISHED
        request.finish_reason = reason

    def abort(self, request: Request) -> None:
        if request.done:
            return
        if request in self.running:
            self._release(request, keep_in_cache=True)
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.state = RequestState.ABORTED
        request.finish_reason = "abort"

    # ---- one step -----------------------------------------------------------------------------

    def schedule(self) -> ScheduleBatch | None:
        decodes = self._schedule_decodes()
        budget = self.config.max_batch_tokens - len(decodes)
        chunks: list[ScheduledChunk] = []
        # (Only when some running request does not decode: most steps, none prefills.)
        prefilling = [r for r in self.running if r.state == PREFILLING] if len(decodes) < len(self.running) else []
        rows = len(decodes)
        for request in prefilling:
            if budget <= 0 or rows >= self.config.max_logit_rows:
                break
            chunk = self._prefill_chunk(request, budget, self.config.max_logit_rows - rows)
            if chunk is None:
                break
            chunks.append(chunk)
            budget -= chunk.end - chunk.start
            rows += logit_rows(chunk)
        chunks.extend(self._admit(budget, rows))
        if not decodes and not chunks and self.running:
            # Nothing fits and nothing runs to free memory: make room by retracting the youngest.
            self._retract(max(self.running, key=lambda r: r.arrival))
            return self.schedule()
        return ScheduleBatch(decodes, chunks) if decodes or chunks else None

    def complete_step(self, batch: ScheduleBatch) -> None:
        """Records that the batch's KV is computed. The caller appends sampled tokens afterwards."""
        for request in batch.decodes:
            request.num_computed += 1
        for chunk in batch.chunks:
            request = chunk.request
            request.num_computed = chunk.end
            if chunk.wants_logits and request.state == PREFILLING:
                request.state = DECODING
                self._share_prompt(request)

    def reserve_drafts(self, request: Request, count: int) -> int:
        """Pages for up to ``count`` draft tokens after a decoding request's next token (its KV
        slots in a verify step), as many as the pool gives without retracting anyone: the count
        covered. (After ``_schedule_decodes``, which gave the next token its page.)"""
        while count > 0:
            need = self._pages_needed(request, request.num_computed + 1 + count)
            if self._reserve(need):
                request.pages.extend(self.allocator.alloc(need) if need else [])
                return count
            count -= 1
        return 0

    def complete_verify(self, request: Request, accepted: int) -> None:
        """Records a verify step's accepted drafts (``complete_step`` counted the step's first token):
        their KV is computed; the pages past the computed tokens (rejected drafts') go back to the
        pool. Only computed tokens are ever inserted into the radix tree, so rejected drafts never are."""
        request.num_computed = min(request.num_computed + accepted, request.total_len)
        keep = -(-request.num_computed // self.config.page_size)
        if len(request.pages) > keep:
            self.allocator.free(request.pages[keep:])
            del request.pages[keep:]

    # ---- internals --------------------------------------------------------------------------------

    def _schedule_decodes(self) -> list[Request]:
        # Every decoding request adds one token, at position num_computed; those whose pages are full
        # need one more page. (This runs every step over every running request: the page check is
        # inline, _pages_needed(r, r.num_computed + 1) > 0, without a call per request.)
        size = self.config.page_size
        while True:
            decodes = [r for r in self.running if r.state == DECODING]
            growing = [r for r in decodes if r.num_computed >= len(r.pages) * size]
            if self._reserve(len(growing)):
                break
            self._retract(max(self.running, key=lambda r: r.arrival))
        for request in growing:
            request.pages.extend(self.allocator.alloc(1))
        return decodes

    def _prefill_chunk(self, request: Request, budget: int, row_room: int) -> ScheduledChunk | None:
        if request.params.prompt_logprobs:
            budget = min(budget, row_room)  # a logits row for every position it computes
        end = request.num_computed + min(request.remaining, budget)
        need = self._pages_needed(request, end)
        if not self._reserve(need):
            return None
        request.pages.extend(self.allocator.alloc(need) if need else [])
        return ScheduledChunk(request, request.num_computed, end, end == request.total_len)

    def _admit(self, budget: int, rows: int) -> list[ScheduledChunk]:
        chunks = []
        for request in self._admission_order():
            if budget <= 0 or len(self.running) >= self.config.max_running or rows >= self.config.max_logit_rows:
                break
            if request.leader is not None and not (request.leader.prompt_inserted or request.leader.done):
                continue  # share the leader's prompt pages once they are cached
            if self._shares_with_admitted(request, [c.request for c in chunks]):
                continue  # computing it now would repeat an admitted request's prefix: wait for its cache entry
            if request.lora is not None and not self._pin_adapter(request):
                continue  # every adapter slot is pinned by running requests: wait for one to finish
            self._attach_prefix(request)
            chunk = self._prefill_chunk(request, budget, self.config.max_logit_rows - rows)
            if chunk is None:
                self._release(request, keep_in_cache=False)
                break
            self.waiting.remove(request)
            self.running.append(request)
            request.state = RequestState.PREFILLING
            chunks.append(chunk)
            budget -= chunk.end - chunk.start
            rows += logit_rows(chunk)
        return chunks

    def _admission_order(self) -> list[Request]:
        queue = list(self.waiting)
        if self.config.policy == "lpm" and self.config.enable_prefix_cache and len(queue) <= LPM_MAX_QUEUE:
            # Retracted requests keep their place at the front; the rest go by cached prefix length.
            def cached(r: Request) -> int:
                return self.cache.cached_length(r.namespace, r.all_ids[:-1])

            queue.sort(key=lambda r: (r.retractions == 0, -cached(r), r.arrival))
        return queue

    def _shares_with_admitted(self, request: Request, admitted: list[Request]) -> bool:
        """True when ``request`` shares a prefix with a request admitted this step that is much longer
        than what the cache holds for it: it then waits a step or two and reuses those pages."""
        if not self.config.enable_prefix_cache or not admitted:
            return False
        ids = request.all_ids
        cached = self.cache.cached_length(request.namespace, ids[:-1])
        for other in admitted:
            if other.namespace == request.namespace and \
                    _common_prefix(ids, other.all_ids) - cached >= IN_BATCH_SHARE_TOKENS:
                return True
        return False

    def _pin_adapter(self, request: Request) -> bool:
        if not self.adapters.pin(request.lora):
            return False
        request.lora_slot = request.lora.slot
        return True

    def _attach_prefix(self, request: Request) -> None:
        if not self.config.enable_prefix_cache:
            return
        # Leave the last token out: its logits are needed, so it is always computed. A request that
        # wants its prompt's logprobs computes every position: it matches nothing.
        scored = len(request.prompt_logprobs) >= len(request.prompt_ids) - 1
        wanted = request.all_ids[:-1] if scored or not request.params.prompt_logprobs else []
        match = self.cache.match_prefix(request.namespace, wanted)
        self.cache.lock(match.node)
        request.prefix = match
        request.pages = list(match.pages)
        request.num_computed = match.length
        if request.retractions == 0:
            request.cached_tokens = match.length

    def _share_prompt(self, request: Request) -> None:
        """Puts a freshly prefilled request's full pages into the cache so others can share them."""
        request.prompt_inserted = True
        if not self.config.enable_prefix_cache:
            return
        full = request.num_computed // self.config.page_size
        if full == 0:
            return
        tokens = request.all_ids[:full * self.config.page_size]
        match = self.cache.insert_running(request.namespace, tokens, request.pages[:full], request.prefix.node)
        request.pages[:full] = match.pages
        request.prefix = match

    def _release(self, request: Request, keep_in_cache: bool) -> None:
        """Gives back a request's KV: computed full pages to the cache, the rest to the pool."""
        owned_from = len(request.prefix.pages) if request.prefix is not None else 0
        if self.config.enable_prefix_cache and request.prefix is not None:
            full = min(request.num_computed // self.config.page_size, len(request.pages)) if keep_in_cache else owned_from
            self.cache.insert(request.namespace, request.all_ids[:full * self.config.page_size], request.pages[:full])
            self.allocator.free(request.pages[full:])
            self.cache.unlock(request.prefix.node)
        else:
            self.allocator.free(request.pages[owned_from:])
        request.pages = []
        request.prefix = None
        request.num_computed = 0
        if request.lora_slot >= 0:  # it stops running: its adapter's slot may go to another
            self.adapters.unpin(request.lora)
            request.lora_slot = -1

    def _retract(self, request: Request) -> None:
        self._release(request, keep_in_cache=True)
        self.running.remove(request)
        request.state = RequestState.WAITING
        request.retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(request)

    def _pages_needed(self, request: Request, upto_tokens: int) -> int:
        size = self.config.page_size
        return max(0, -(-upto_tokens // size) - len(request.pages))

    def _reserve(self, pages: int) -> bool:
        """True when ``pages`` pages are free, evicting unlocked cache entries if needed."""
        short = pages - self.allocator.free_count
        if short > 0 and self.config.enable_prefix_cache:
            self.cache.evict(short)
        return self.allocator.free_count >= pages


def prompt_logprob_positions(chunk: ScheduledChunk) -> range:
    """The chunk's positions whose logits score the next prompt token (those before the prompt's
    last token, which is sampled from): empty unless its request wants prompt logprobs."""
    request = chunk.request
    if not request.params.prompt_logprobs:
        return range(0)
    return range(chunk.start, min(chunk.end, len(request.prompt_ids) - 1))


def logit_rows(chunk: ScheduledChunk) -> int:
    return len(prompt_logprob_positions(chunk)) + (1 if chunk.wants_logits else 0)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
