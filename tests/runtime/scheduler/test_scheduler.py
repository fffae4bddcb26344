"""Scheduler batches: decoding requests come first, one token each, then the prefill chunks."""

from kiln.runtime.kvcache.allocator import PageAllocator
from kiln.runtime.kvcache.radix import RadixCache
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.scheduler.request import Request
from kiln.runtime.scheduler.scheduler import Scheduler, SchedulerConfig

PAGE = 4


def _scheduler() -> Scheduler:
    allocator = PageAllocator(64)
    return Scheduler(SchedulerConfig(max_batch_tokens=32, max_running=8, page_size=PAGE), allocator,
                     RadixCache(allocator, PAGE))


def _step(scheduler: Scheduler, token: int = 9):
    """Schedules and completes one step, appending ``token`` to each sampled request."""
    batch = scheduler.schedule()
    scheduler.complete_step(batch)
    for request in batch.decodes:
        request.output_ids.append(token)
    for chunk in batch.chunks:
        if chunk.wants_logits:
            chunk.request.output_ids.append(token)
    return batch


def test_decoding_requests_lead_the_batch():
    scheduler = _scheduler()
    first = [Request(f"r{i}", [1 + i, 2, 3, 4, 5], SamplingParams(), seed=0) for i in range(2)]
    for request in first:
        scheduler.add(request)
    assert _step(scheduler).decodes == []                     # both prefill
    late = Request("late", [7, 8, 9], SamplingParams(), seed=0)
    scheduler.add(late)
    mixed = _step(scheduler)
    assert mixed.decodes == first
    assert [(c.request, c.end - c.start, c.wants_logits) for c in mixed.chunks] == [(late, 3, True)]
    decode = _step(scheduler)
    assert decode.decodes == first + [late] and decode.chunks == []
    # A decoding request has computed all its tokens but the last, the next step's input.
    assert all(r.num_computed == r.total_len - 1 for r in decode.decodes)
