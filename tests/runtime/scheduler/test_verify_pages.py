"""The scheduler's side of a verify step: pages for a decoding request's drafts, then the accepted
ones counted as computed and the rejected ones' pages given back; the verify step's lists."""

from kiln.runtime.kvcache.allocator import PageAllocator
from kiln.runtime.kvcache.radix import RadixCache
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.scheduler.batch import build_verify_lists
from kiln.runtime.scheduler.request import Request
from kiln.runtime.spec.tree import DraftTree
from kiln.runtime.scheduler.scheduler import Scheduler, SchedulerConfig

PAGE = 4


def _decoding(pages: int = 16) -> tuple[Scheduler, Request]:
    """A scheduler and one request that has prefilled 6 prompt tokens and sampled a 7th."""
    allocator = PageAllocator(pages)
    scheduler = Scheduler(SchedulerConfig(max_batch_tokens=32, max_running=8, page_size=PAGE), allocator,
                          RadixCache(allocator, PAGE))
    request = Request("r", [1, 2, 3, 4, 5, 6], SamplingParams(), seed=0)
    scheduler.add(request)
    scheduler.complete_step(scheduler.schedule())
    request.output_ids.append(7)
    return scheduler, request


def test_drafts_get_pages_and_rejected_ones_give_them_back():
    scheduler, request = _decoding()
    batch = scheduler.schedule()
    assert batch.decodes == [request] and len(request.pages) == 2    # token 7 at position 6
    free = scheduler.allocator.free_count
    assert scheduler.reserve_drafts(request, 5) == 5                # positions 7..11: one more page
    assert len(request.pages) == 3 and scheduler.allocator.free_count == free - 1
    lists = build_verify_lists(batch, [DraftTree.chain([8, 9, 10, 11, 12])], PAGE)
    assert lists.token_ids == [7, 8, 9, 10, 11, 12] and lists.positions == list(range(6, 12))
    assert lists.q_len == [6] and lists.kv_len == [12] and lists.logits_index == list(range(6))
    assert lists.requests == [request] * 6
    pages = request.pages
    assert lists.slots == [pages[p // PAGE] * PAGE + p % PAGE for p in range(6, 12)]
    scheduler.complete_step(batch)
    # One draft accepted (8) and an extra token (13): tokens 7 and 8 computed, 9.. rejected.
    request.output_ids += [8, 13]
    scheduler.complete_verify(request, 1)
    assert request.num_computed == 8 and request.remaining == 1
    assert len(request.pages) == 2 and scheduler.allocator.free_count == free


def test_a_tree_is_laid_side_by_side_at_the_positions_of_its_depths():
    """Root 7 at position 6; nodes 8 and 9 its children (position 7), 10 under 9 (position 8): slots
    consecutive, each node's mask row the context before the root, the root and its ancestors."""
    scheduler, request = _decoding()
    batch = scheduler.schedule()
    scheduler.reserve_drafts(request, 3)
    lists = build_verify_lists(batch, [DraftTree([8, 9, 10], [-1, -1, 1])], PAGE, tree_masks=True)
    assert lists.token_ids == [7, 8, 9, 10] and lists.positions == [6, 7, 7, 8] and lists.kv_len == [10]
    pages = request.pages
    assert lists.slots == [pages[p // PAGE] * PAGE + p % PAGE for p in range(6, 10)]
    # The window is the context's last 32 keys: key k is bit k + 22 (context 10); keys 0..6 the root's prefix.
    prefix = sum(1 << (k + 22) for k in range(7))
    assert lists.tree_mask == [prefix, prefix | 1 << 29, prefix | 1 << 30,
                               (prefix | 1 << 30 | 1 << 31) - (1 << 32)]


def test_drafts_take_what_the_pool_has_without_retracting():
    scheduler, request = _decoding(pages=4)                         # page 0 reserved: 3 usable
    scheduler.schedule()
    assert scheduler.reserve_drafts(request, 9) == 5                # up to position 11: the third page
    assert scheduler.allocator.free_count == 0 and scheduler.reserve_drafts(request, 9) == 5
    assert scheduler.num_retractions == 0


def test_accepted_drafts_at_a_stop_count_only_the_kept_tokens():
    scheduler, request = _decoding()
    batch = scheduler.schedule()
    scheduler.reserve_drafts(request, 3)
    scheduler.complete_step(batch)
    request.output_ids += [8]                                       # 3 accepted, the chain cut after 8
    scheduler.complete_verify(request, 3)
    assert request.num_computed == request.total_len == 8
    scheduler.finish(request, "stop")
    assert scheduler.cache.cached_length(None, [1, 2, 3, 4, 5, 6, 7, 8, 99]) == 8
