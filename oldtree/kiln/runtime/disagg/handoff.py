"""Moving a prefilled prompt's KV pages out of one engine's cache and into another's.

The prefill engine runs a request's prompt (and samples one token, which it drops); its scheduler
then caches the prompt's whole pages in the radix tree, as it does for every finished request, so
its prefix cache works as usual. ``export_prompt`` reads those pages' K and V from the pool: the
longest cached page-aligned prefix of the prompt.

The decode engine's ``import_prompt`` writes them into freshly allocated pages of its own pool and
inserts them into its radix tree under the same token ids. The request then goes to the decode
engine as a normal request: its prefix match finds all but the prompt's last partial page (at
least one token is always left to compute the first token's logits from), so the decode engine
computes at most ``page_size`` prompt tokens itself, then decodes. Pages the tree held already are
kept and the copies freed (``RadixCache.insert``), and imported pages are evictable like any other:
the handoff never changes what a request computes, only how much of it is reused.

One rank only: a tensor-parallel engine's KV heads are spread over processes whose pools this
process cannot read (``support.check_core``).
"""

from __future__ import annotations

import torch

from ..engine_core import EngineCore
from ..sampling import SamplingParams
from .kv_link import Handoff, KVLink
from .support import check_core


def export_prompt(core: EngineCore, room: int, prompt_ids: list[int]) -> Handoff:
    """The cached whole pages of ``prompt_ids`` in ``core`` (after its prefill finished), as a handoff."""
    check_core(core)
    match = core.cache.peek_prefix(None, prompt_ids)
    slots = _slots(match.pages, core.page_size, core.runner.pool.device)
    kv = core.runner.pool.buffer.index_select(2, slots)  # stays on the pool's device: the link moves it
    return Handoff(room, list(prompt_ids[:match.length]), kv)


def import_prompt(core: EngineCore, handoff: Handoff) -> int:
    """Caches the handoff's KV in ``core``'s pool and radix tree; returns the tokens it added (0 when the
    pool has no room even after evicting, which only costs the decode side the prompt's prefill)."""
    check_core(core)
    pool = core.runner.pool
    expected = (pool.num_layers, 2, len(handoff.token_ids), pool.kv_heads, pool.head_dim)
    if tuple(handoff.kv.shape) != expected or handoff.kv.dtype != pool.dtype:
        raise ValueError(f"handoff: KV of shape {tuple(handoff.kv.shape)} {handoff.kv.dtype} does not fit this "
                         f"engine's pool ({expected} {pool.dtype}): are both sides serving the same artifact?")
    num_pages = len(handoff.token_ids) // core.page_size
    if num_pages == 0:
        return 0
    if core.allocator.free_count < num_pages:
        core.cache.evict(num_pages - core.allocator.free_count)
    pages = core.allocator.alloc(num_pages)
    if pages is None:
        return 0
    slots = _slots(pages, core.page_size, pool.device)
    pool.buffer.index_copy_(2, slots, handoff.kv.to(pool.device))
    already = core.cache.insert(None, handoff.token_ids, pages)  # the tree owns the pages from here
    return len(handoff.token_ids) - already


def _slots(pages: list[int], page_size: int, device: torch.device) -> torch.Tensor:
    """The pool slots of ``pages``, in order."""
    first = torch.tensor(pages, dtype=torch.int64, device=device) * page_size
    return (first[:, None] + torch.arange(page_size, device=device)).reshape(-1)


def prefill_and_hand_off(core: EngineCore, link: KVLink, prompts: dict[int, list[int]]) -> None:
    """The prefill side's work for a batch of rooms: prefills every prompt together (one token each, dropped),
    then sends each room's cached pages over ``link``, in room order."""
    for room, prompt_ids in prompts.items():
        core.add_request(f"prefill-{room}", prompt_ids, SamplingParams(temperature=0, max_new_tokens=1,
                                                                       ignore_eos=True))
    while core.has_work():
        core.step()
    for room, prompt_ids in prompts.items():
        link.send(export_prompt(core, room, prompt_ids))


def receive_prompt(core: EngineCore, link: KVLink) -> Handoff:
    """The decode side: the next handoff from ``link``, cached in ``core`` (then add its request as usual)."""
    handoff = link.receive()
    import_prompt(core, handoff)
    return handoff
