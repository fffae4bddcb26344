"""Row gathers: token embedding lookup and picking the rows whose logits are wanted."""

from __future__ import annotations

import torch

from .registry import register_impl


def ref_embedding(ids: torch.Tensor, table: torch.Tensor, row_start: torch.Tensor | None = None) -> torch.Tensor:
    if row_start is None:
        return table[ids.long()]
    rows = torch.zeros(ids.shape[0], table.shape[1], dtype=table.dtype)
    for i, token in enumerate(ids.tolist()):
        local = token - int(row_start)
        if 0 <= local < table.shape[0]:
            rows[i] = table[local]
    return rows


def ref_gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x[index.long()]


def _embedding(ids, table, row_start=None, *, out):
    if row_start is None:
        torch.index_select(table, 0, ids, out=out)
        return
    # One rank's shard of the vocabulary: ids of other shards read row 0 and are zeroed after, with no
    # host sync (the step may be captured).
    local = ids - row_start
    inside = (local >= 0) & (local < table.shape[0])
    torch.index_select(table, 0, torch.where(inside, local, 0), out=out)
    out.masked_fill_(~inside.unsqueeze(1), 0)


def _gather_rows(x, index, *, out):
    torch.index_select(x, 0, index, out=out)


register_impl("embedding", "torch", _embedding)
register_impl("gather_rows", "torch", _gather_rows)
