"""The paged KV pool: one tensor holding every layer's K and V, and the math that sizes it.

The pool is ``[num_layers, 2, num_pages * page_size, kv_heads, head_dim]``; the compiled graph sees
per layer ``k_cache.{i}`` and ``v_cache.{i}``, views ``[NS, kv_heads, head_dim]`` of that one
tensor (NS = num_pages * page_size; slot = page * page_size + offset). Page 0 is reserved by the
allocator, so a page count always includes it: a pool of ``num_pages`` pages holds
``(num_pages - 1) * page_size`` tokens of context. Under tensor parallelism ``kv_heads`` is the
per-rank count.

Sizing, three ways:
- ``pages_for_tokens``: an explicit capacity in tokens (what CPU runs use);
- ``pages_for_budget``: however many pages fit in a byte budget;
- ``pages_for_mem_fraction``: SGLang's ``--mem-fraction-static`` rule on a CUDA device: weights and
  KV together may use ``mem_fraction`` of the device's total memory, so the KV budget is what is
  free now, less the weights still to be loaded (the pool is sized before they reach the device,
  because every rank receives its page count with its start-up settings), less the
  ``1 - mem_fraction`` share left for activations, CUDA graphs and other users.
"""

from __future__ import annotations

import math
import mmap
from typing import Any, Mapping

import torch

from kiln.tensors import torch_dtype

from .allocator import RESERVED_PAGE


def pool_dtype(runtime: Mapping[str, Any]) -> torch.dtype:
    """The pool's dtype as an artifact's manifest records it (``runtime.kv_cache_dtype``: the model's
    dtype, or f8e4m3 for an FP8 KV cache, which holds twice the tokens in the same bytes); artifacts
    from before FP8 KV caches record only the model's."""
    return torch_dtype(runtime.get("kv_cache_dtype", runtime["dtype"]))


def bytes_per_page(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, page_size: int) -> int:
    """Bytes one page takes across all layers, K and V."""
    return num_layers * 2 * page_size * kv_heads * head_dim * dtype.itemsize


def pages_for_tokens(num_tokens: int, page_size: int) -> int:
    """The page count (reserved page included) whose usable pages hold ``num_tokens`` tokens, rounded up."""
    if num_tokens < 1 or page_size < 1:
        raise ValueError(f"need num_tokens >= 1 and page_size >= 1, got {num_tokens} and {page_size}")
    return -(-num_tokens // page_size) + 1


def pages_for_budget(bytes_available: int, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                     page_size: int) -> int:
    """How many pages (reserved page included) fit in ``bytes_available``; 0 when the budget is negative."""
    return max(0, bytes_available) // bytes_per_page(num_layers, kv_heads, head_dim, dtype, page_size)


def kv_budget_bytes(mem_fraction: float, free_bytes: int, total_bytes: int, weight_bytes: int = 0) -> int:
    """The KV budget under ``mem_fraction``: ``free_bytes`` measured now, ``weight_bytes`` of weights
    still to come onto the device."""
    if not 0.0 < mem_fraction <= 1.0:
        raise ValueError(f"mem_fraction must be in (0, 1], got {mem_fraction}")
    return int(free_bytes - weight_bytes - total_bytes * (1.0 - mem_fraction))


def pages_for_mem_fraction(mem_fraction: float, device: torch.device | str, num_layers: int, kv_heads: int,
                           head_dim: int, dtype: torch.dtype, page_size: int, weight_bytes: int) -> int:
    """The page count for a CUDA device under ``mem_fraction``, before ``weight_bytes`` of weights
    are loaded onto it."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"a memory fraction sizes CUDA pools only; on {device.type} give an explicit token count")
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    budget = kv_budget_bytes(mem_fraction, free_bytes, total_bytes, weight_bytes)
    num_pages = pages_for_budget(budget, num_layers, kv_heads, head_dim, dtype, page_size)
    if num_pages < 2:
        raise ValueError(f"mem_fraction {mem_fraction} leaves {budget} bytes for the KV cache "
                         f"({free_bytes} free of {total_bytes}, {weight_bytes} of weights to load): "
                         f"not even one page; raise it")
    return num_pages


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor. On the CPU it lies in anonymous memory, which the OS zero-fills a page at
    a time when first touched: ``torch.zeros`` writes every byte up front (seconds for a pool of a
    few GB, at every start), this costs nothing until the pages are used."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    memory = mmap.mmap(-1, max(nbytes, 1))  # the tensor keeps the mapping alive
    return torch.frombuffer(memory, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


class KVPool:
    """Owns the pool tensor. Zero-filled so the reserved page reads as finite zeros, never NaN."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, num_pages: int, page_size: int, first_layer: int = 0) -> None:
        if num_pages < 2 or page_size < 1:
            raise ValueError(f"need num_pages >= 2 (page {RESERVED_PAGE} is reserved) and page_size >= 1, "
                             f"got {num_pages} and {page_size}")
        self.num_layers = num_layers
        self.first_layer = first_layer  # a pipeline stage's pool holds layers first_layer.. of the model
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.buffer = _zeros((num_layers, 2, self.num_slots, kv_heads, head_dim), dtype, torch.device(device))

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def k(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s K cache, ``[NS, kv_heads, head_dim]``, a view of the pool."""
        return self.buffer[layer, 0]

    def v(self, layer: int) -> torch.Tensor:
        return self.buffer[layer, 1]

    def layer_views(self) -> dict[str, torch.Tensor]:
        """The graph's cache inputs by name: ``k_cache.{i}`` and ``v_cache.{i}`` for every layer i it holds."""
        views: dict[str, torch.Tensor] = {}
        for layer in range(self.num_layers):
            views[f"k_cache.{self.first_layer + layer}"] = self.k(layer)
            views[f"v_cache.{self.first_layer + layer}"] = self.v(layer)
        return views

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Every layer's K and V at slots ``src`` copied to slots ``dst`` (all read before any is
        written, so the two may overlap): a verify step's accepted tree path moved into place."""
        index = torch.tensor(src, device=self.device)
        self.buffer[:, :, torch.tensor(dst, device=self.device)] = self.buffer[:, :, index]
