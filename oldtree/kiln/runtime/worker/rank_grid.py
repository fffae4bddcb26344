"""The rank grid of a pipelined artifact: ``pp`` stages of ``tp`` tensor-parallel ranks each.

Rank ``R`` is tensor-parallel rank ``R % tp`` of stage ``R // tp``, so the stages are consecutive
blocks of ranks and rank 0 (the engine core's) is in stage 0::

    tp=2, pp=2:   stage 0: ranks 0 1     stage 1: ranks 2 3
                  tp groups: {0, 1} {2, 3}     pp groups: {0, 2} {1, 3}

A rank's ``tp`` group holds its stage's ranks (the ``all_reduce`` / ``all_gather`` of its shard); its
``pp`` group holds the ranks of its tensor-parallel rank in every stage, in stage order, so that a
``send`` / ``recv`` peer in the program is a stage number. The programs name the groups by these
axes (``group="tp"``); ``join_groups`` makes them and hands them to the collective kernels, with
``logits``: the same ranks as ``pp``, for the logits' way back from the last stage to stage 0 (its
own communicator, so that on NCCL those transfers never queue behind the hidden states going
forward on the ``pp`` one, nor these behind them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from kiln.kernels.collective import use_groups


@dataclass(frozen=True)
class RankGrid:
    tp: int
    pp: int

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def stage(self, rank: int) -> int:
        return rank // self.tp

    def tp_group(self, stage: int) -> list[int]:
        return [stage * self.tp + t for t in range(self.tp)]

    def pp_group(self, tp_rank: int) -> list[int]:
        return [stage * self.tp + tp_rank for stage in range(self.pp)]


def join_groups(grid: RankGrid, rank: int) -> dict[str, dist.ProcessGroup]:
    """Makes every group of the grid (each rank of the default group makes all of them, in the same
    order, as torch.distributed asks) and gives this rank's to the collective kernels."""
    mine: dict[str, dist.ProcessGroup] = {}
    for stage in range(grid.pp):
        group = dist.new_group(grid.tp_group(stage))
        if grid.stage(rank) == stage:
            mine["tp"] = group
    for name in ("pp", "logits"):
        for tp_rank in range(grid.tp):
            group = dist.new_group(grid.pp_group(tp_rank))
            if rank % grid.tp == tp_rank:
                mine[name] = group
    use_groups(mine)
    return mine


def leave_groups() -> None:
    """Forgets this process's groups (the engine closing its torch.distributed group)."""
    use_groups({})
