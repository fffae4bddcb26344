"""The KV cache of the runtime: the paged pool tensor (``pool``), which pages are free
(``allocator``), and which cached token prefixes own which pages (``radix``)."""

from .allocator import RESERVED_PAGE, PageAllocator
from .pool import (KVPool, bytes_per_page, kv_budget_bytes, pages_for_budget, pages_for_mem_fraction,
                   pages_for_tokens)
from .radix import PrefixMatch, RadixCache, RadixNode

__all__ = [
    "RESERVED_PAGE", "PageAllocator", "KVPool", "bytes_per_page", "kv_budget_bytes", "pages_for_budget",
    "pages_for_mem_fraction", "pages_for_tokens", "PrefixMatch", "RadixCache", "RadixNode",
]
