"""Row gathers: token embedding lookup and picking the rows whose logits are wanted."""

from __future__ import annotations

import torch

from .registry import register_impl


def ref_embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table[ids.long()]


def ref_gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x[index.long()]


def _embedding(ids, table, *, out):
    torch.index_select(table, 0, ids, out=out)


def _gather_rows(x, index, *, out):
    torch.index_select(x, 0, index, out=out)


register_impl("embedding", "torch", _embedding)
register_impl("gather_rows", "torch", _gather_rows)
