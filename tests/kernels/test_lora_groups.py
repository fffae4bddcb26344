"""The lora_groups op: the reference groups every row of an adapter into its slot's tiles, in token order;
the Triton version (token slots, then moe_align) writes the same first tiles."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.lora_groups import grouped_slots, ref_lora_groups, tile_count, triton_lora_groups
from kiln.lora_layout import TILE_ROWS


def _step(lengths, slots, tokens, device):
    """A step's sequence columns; padding sequences (q_len 0) start at ``tokens``, as the runtime pads."""
    starts, row = [], 0
    for n in lengths:
        starts.append(row if n else tokens)
        row += n
    ints = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    return ints(slots), ints(starts), ints(lengths)


CASES = [
    # (sequence lengths, slot of each, tokens in the step (padded), slots)
    ([1, 1, 1, 1], [0, -1, 2, 0], 4, 3),                             # decode
    ([1] * 64, [i % 9 - 1 for i in range(64)], 64, 8),               # decode, 8 adapters and the base model
    ([1] * 37, [2] * 37, 40, 3),                                     # one adapter, three tiles, padding rows
    ([5, 17, 3, 0], [0, -1, 1, 1], 31, 2),                           # prefill, a padding sequence, odd T
    ([20, 1, 1, 9, 40], [2, 0, -1, 2, 2], 71, 3),                    # mixed; slot 2 over several sequences
    ([3, 2], [-1, -1], 5, 4),                                        # no adapter at all: no tile
    ([1], [1], 1, 8),                                                # one row
]


@pytest.mark.parametrize("lengths,slots,tokens,num_slots", CASES)
def test_reference_groups_each_adapters_rows_in_token_order(lengths, slots, tokens, num_slots, device):
    rows, tiles = ref_lora_groups(*_step(lengths, slots, tokens, device), tokens, num_slots)
    per_row = [s for s, n in zip(slots, lengths) for _ in range(n)] + [-1] * (tokens - sum(lengths))
    used = tile_count(tokens, num_slots)
    expected_rows, expected_tiles = [], []
    for slot in range(num_slots):
        mine = [r for r, s in enumerate(per_row) if s == slot]
        for first in range(0, len(mine), TILE_ROWS):
            part = mine[first:first + TILE_ROWS]
            expected_rows.append(part + [tokens] * (TILE_ROWS - len(part)))
            expected_tiles.append(slot)
    assert len(expected_tiles) <= used
    assert tiles.tolist() == expected_tiles + [-1] * (tokens - len(expected_tiles))
    assert rows[:len(expected_rows)].tolist() == expected_rows
    assert (rows[len(expected_rows):] == tokens).all()
    assert grouped_slots(rows, tiles, num_slots).tolist() == per_row


@pytest.mark.parametrize("lengths,slots,tokens,num_slots", CASES)
def test_triton_writes_the_reference_tiles(lengths, slots, tokens, num_slots, device):
    step = _step(lengths, slots, tokens, device)
    expected_rows, expected_tiles = ref_lora_groups(*step, tokens, num_slots)
    rows = torch.full((tokens, TILE_ROWS), -7, dtype=torch.int32, device=device)
    tiles = torch.full((tokens,), -7, dtype=torch.int32, device=device)
    triton_lora_groups(*step, out=(rows, tiles), slots=num_slots)
    used = tile_count(tokens, num_slots)
    assert torch.equal(rows[:used], expected_rows[:used])
    assert torch.equal(tiles[:used], expected_tiles[:used])
