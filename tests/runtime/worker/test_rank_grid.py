"""The rank grid's layout: stages in consecutive blocks of ranks, a tp group per stage, a pp group per
tensor rank (the groups themselves run in tests/kernels/test_collective.py)."""

from kiln.runtime.worker.rank_grid import RankGrid


def test_the_rank_grid_puts_stages_in_consecutive_blocks():
    grid = RankGrid(tp=2, pp=2)
    assert [grid.stage(rank) for rank in range(4)] == [0, 0, 1, 1]
    assert grid.tp_group(1) == [2, 3] and grid.pp_group(1) == [1, 3]
