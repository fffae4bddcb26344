"""The collectives' kernels in real processes over gloo on loopback, against their ``ref_`` versions
(every rank's input is made from a seed all ranks know): 3 ranks, several shapes with odd
sizes, every axis; send/recv between neighbours; and in the groups of a tp=2 x pp=2 rank grid
(``group="tp"``: a stage's ranks; ``group="pp"``: peers by stage). Also the vocab-parallel embedding
(``row_start``) against its reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kiln.kernels import get_impl
from kiln.kernels.collective import ref_all_gather, ref_all_reduce, ref_reduce_scatter
from kiln.kernels.embedding import ref_embedding
from kiln.runtime.worker.rank_grid import RankGrid, join_groups

SHAPES = [(3, 5), (1, 7), (4, 3, 2)]


def inputs(shape: tuple[int, ...], ranks: int, seed: int) -> list[torch.Tensor]:
    """Every rank's input, the same on every rank."""
    generator = torch.Generator().manual_seed(seed * 1000 + sum(shape) * 31 + ranks)
    return [torch.randn(shape, generator=generator) for _ in range(ranks)]


def check_rank(rank: int, ranks: int, store_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=ranks)
    try:
        for shape in SHAPES:
            xs = inputs(shape, ranks, 1)
            out = torch.empty(shape)
            get_impl("torch.all_reduce").fn(xs[rank], out=out, world_size=ranks)
            torch.testing.assert_close(out, ref_all_reduce(xs))
            for axis in range(len(shape)):
                gathered = torch.empty(ref_all_gather(xs, axis).shape)
                get_impl("torch.all_gather").fn(xs[rank], out=gathered, axis=axis, world_size=ranks)
                assert torch.equal(gathered, ref_all_gather(xs, axis))
                wide = inputs(tuple(d * ranks if i == axis else d for i, d in enumerate(shape)), ranks, 2)
                mine = torch.empty(shape)
                get_impl("torch.reduce_scatter").fn(wide[rank], out=mine, axis=axis, world_size=ranks)
                torch.testing.assert_close(mine, ref_reduce_scatter(wide, axis, rank))
        # A ring: each rank sends its tensor to the next and receives the previous one's.
        xs = inputs((2, 3), ranks, 3)
        got = torch.empty(2, 3)
        if rank % 2 == 0:
            get_impl("torch.send").fn(xs[rank], peer=(rank + 1) % ranks)
            get_impl("torch.recv").fn(out=got, shape=[2, 3], dtype="f32", peer=(rank - 1) % ranks)
        else:
            get_impl("torch.recv").fn(out=got, shape=[2, 3], dtype="f32", peer=(rank - 1) % ranks)
            get_impl("torch.send").fn(xs[rank], peer=(rank + 1) % ranks)
        assert torch.equal(got, xs[(rank - 1) % ranks])
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("ranks", [3])
def test_collectives_match_their_references(tmp_path, ranks):
    mp.start_processes(check_rank, args=(ranks, str(tmp_path / "store")), nprocs=ranks, start_method="spawn")


def test_a_collective_refuses_a_group_of_another_size():
    with pytest.raises(RuntimeError, match="compiled for 2 ranks and runs in a group of 1"):
        get_impl("torch.all_reduce").fn(torch.zeros(2), out=torch.zeros(2), world_size=2)
    with pytest.raises(RuntimeError, match="over the 'tp' group, and this process joined none"):
        get_impl("torch.all_reduce").fn(torch.zeros(2), out=torch.zeros(2), world_size=2, group="tp")


def check_grid_rank(rank: int, store_file: str) -> None:
    grid = RankGrid(tp=2, pp=2)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=grid.world_size)
    join_groups(grid, rank)
    try:
        xs = inputs((3, 5), grid.world_size, 4)
        stage_inputs = [xs[r] for r in grid.tp_group(grid.stage(rank))]
        out = torch.empty(3, 5)
        get_impl("torch.all_reduce").fn(xs[rank], out=out, world_size=2, group="tp")
        torch.testing.assert_close(out, ref_all_reduce(stage_inputs))
        gathered = torch.empty(3, 10)
        get_impl("torch.all_gather").fn(xs[rank], out=gathered, axis=1, world_size=2, group="tp")
        assert torch.equal(gathered, ref_all_gather(stage_inputs, 1))
        # Stage 0's rank t sends to stage 1's rank t (peer: the stage), which receives from stage 0.
        got = torch.empty(3, 5)
        if grid.stage(rank) == 0:
            get_impl("torch.send").fn(xs[rank], peer=1, group="pp")
        else:
            get_impl("torch.recv").fn(out=got, shape=[3, 5], dtype="f32", peer=0, group="pp")
            assert torch.equal(got, xs[rank - grid.tp])
    finally:
        dist.destroy_process_group()


def test_collectives_run_in_the_groups_of_the_rank_grid(tmp_path):
    mp.start_processes(check_grid_rank, args=(str(tmp_path / "store"),), nprocs=4, start_method="spawn")


@pytest.mark.parametrize("rows, start", [(5, 0), (5, 5), (3, 7), (1, 12)])
def test_vocab_shard_embedding_matches_reference(rows, start):
    table = torch.randn(rows, 6)
    ids = torch.tensor([0, 4, 5, 9, 7, 12, 3, 11], dtype=torch.int32)
    out = torch.empty(len(ids), 6)
    get_impl("torch.embedding").fn(ids, table, torch.tensor([start], dtype=torch.int32), out=out)
    assert torch.equal(out, ref_embedding(ids, table, torch.tensor([start], dtype=torch.int32)))
    assert out.abs().sum(1).ne(0).sum() == sum(start <= i < start + rows for i in ids.tolist())
