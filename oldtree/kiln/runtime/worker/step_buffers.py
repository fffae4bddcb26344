"""Where a step's inputs live for graph replays: one flat int32 buffer, a region per step field.

``StepLayout`` derives the layout from the artifact's step schema (``kiln.step_schema``): vectors
first (token fields, then sequence fields, then logits-row fields), each given its axis' capacity,
then the 2-D tables (``capacity[axis] x width``). The same layout serves the pinned host staging
buffer and the device buffer a graph reads, so a step is staged with plain slice writes and goes to
the device in one copy of a prefix. Views of a bucket (``t`` tokens, ``b`` sequences, ``n`` rows)
have the same addresses on every step, as a captured graph needs.

A field the step's lists do not carry (a feature's input the scheduler has no value for) is staged
as its padding value, so adding a field to the schema needs nothing here.
"""

from __future__ import annotations

from array import array

import torch

from kiln.step_schema import AXES, StepField, StepSchema

from ..scheduler.batch import StepLists

_DTYPES = {"i": torch.int32, "q": torch.int64}


def as_int_tensor(values: list[int], typecode: str) -> torch.Tensor:
    """A non-empty list of ints as an int32 ("i") or int64 ("q") tensor viewing an ``array``'s buffer
    (3x faster than ``torch.tensor`` on a list)."""
    return torch.frombuffer(array(typecode, values), dtype=_DTYPES[typecode])


class StepLayout:
    def __init__(self, schema: StepSchema, capacity: dict[str, int], width: int) -> None:
        """``capacity``: the most entries along each axis; ``width``: each table row's columns."""
        self.schema = schema
        self.width = width
        self.offset: dict[str, int] = {}
        position = 0
        for axis in AXES:
            for field in schema.on(axis):
                self.offset[field.name] = position
                position += capacity[axis]
        for field in schema.tables():
            self.offset[field.name] = position
            position += capacity[field.axis] * width
        self.size = position

    def views(self, buffer: torch.Tensor, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
        """Each field's view for a step of ``sizes`` (entries along each axis)."""
        views = {}
        for field in self.schema:
            start, rows = self.offset[field.name], sizes[field.axis]
            if field.columns is None:
                views[field.name] = buffer[start:start + rows]
            else:
                views[field.name] = buffer[start:start + rows * self.width].view(rows, self.width)
        return views

    def end(self, sizes: dict[str, int]) -> int:
        """The end of what a step of ``sizes`` reads: a copy of the buffer up to here carries it all."""
        tables = self.schema.tables()
        if not tables:
            return self.size
        last = tables[-1]
        return self.offset[last.name] + sizes[last.axis] * self.width

    def write_vectors(self, host: torch.Tensor, lists: StepLists, sizes: dict[str, int], names: list[str],
                      pad: dict[str, int] | None = None) -> None:
        """Writes the vectors ``names`` of ``lists``, padded to ``sizes`` with each field's padding
        value (or ``pad[name]``), into their regions of ``host``."""
        token_count = len(lists.column("token_ids") or ())
        for name in names:
            field = self.schema[name]
            values = lists.column(name)
            rows = sizes[field.axis]
            fill = pad[name] if pad and name in pad else field.pad_value(token_count)
            padded = (values or []) + [fill] * (rows - len(values or ()))
            if padded:
                start = self.offset[name]
                host[start:start + rows] = as_int_tensor(padded, "i")

    def write_table(self, host: torch.Tensor, field: StepField, rows: list[list[int]],
                    held: list[list[int] | None] | None = None) -> None:
        """Writes a table's ragged rows. Only the columns below each row's length are written (a
        step reads no further), and with ``held`` (copies of the rows this buffer holds, updated
        here) only what changed: a decoding row gains a page every page_size steps, and rewriting
        every page of every row took ~2 ms a step at batch 256 with 1024-token contexts. (Copies,
        compared by content: a request's pages may change in place.)"""
        base = self.offset[field.name]
        index: list[int] = []
        values: list[int] = []
        for row, row_values in enumerate(rows):
            keep = 0
            if held is not None:
                before = held[row]
                if before == row_values:
                    continue
                if before is not None and len(before) < len(row_values) and row_values[:len(before)] == before:
                    keep = len(before)
                held[row] = list(row_values)
            start = base + row * self.width
            index.extend(range(start + keep, start + len(row_values)))
            values.extend(row_values[keep:])
        if index:
            host.index_put_((as_int_tensor(index, "q"),), as_int_tensor(values, "i"))
