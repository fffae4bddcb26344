"""Scheduler batches: decoding requests come first, one token each, and the batch says how many."""

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
    for chunk in batch.chunks:
        if chunk.wants_logits:
            chunk.request.output_ids.append(token)
    return batch


def test_decode_chunks_lead_the_batch_and_are_counted():
    scheduler = _scheduler()
    first = [Request(f"r{i}", [1 + i, 2, 3, 4, 5], SamplingParams(), seed=0) for i in range(2)]
    for request in first:
        scheduler.add(request)
    assert _step(scheduler).num_decodes == 0                  # both prefill
    late = Request("late", [7, 8, 9], SamplingParams(), seed=0)
    scheduler.add(late)
    mixed = _step(scheduler)
    assert mixed.num_decodes == 2
    assert [(c.request, c.end - c.start, c.wants_logits) for c in mixed.chunks] == \
        [(first[0], 1, True), (first[1], 1, True), (late, 3, True)]
    decode = _step(scheduler)
    assert decode.num_decodes == len(decode.chunks) == 3
    assert all(c.end - c.start == 1 and c.wants_logits for c in decode.chunks)
