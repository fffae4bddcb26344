"""Splitting a step into micro-batches, for the stages of a pipeline to work on at once.

A step's sequences are cut into up to ``count`` consecutive groups of about equal tokens (a
sequence is never cut). Each part is a step of its own, built from the step-schema fields: the
token fields (``T``) take the part's tokens, the sequence fields (``B``) its sequences, with the
sequence offsets (``q_start``) rebased to the part's first token; the logits rows (``N``) follow
the token each reads (``logits_index``, rebased too). ``rows`` says which of the step's logits rows
each part returns, in the part's order, so the parts' logits put back together are the step's.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.step_schema import LOGIT_ROW, SEQUENCE, TOKEN, StepSchema

from ..scheduler.batch import StepLists

# The fields holding token rows, which a part rebases to its own first token.
TOKEN_OFFSETS = ("q_start", "logits_index")


@dataclass(frozen=True)
class MicroBatch:
    lists: StepLists
    rows: list[int]  # the step's logits rows this part returns, in its order


def split_step(lists: StepLists, schema: StepSchema, count: int) -> list[MicroBatch]:
    """At most ``count`` parts of the step (fewer when it has fewer sequences), in sequence order."""
    q_start, q_len = lists.q_start, lists.q_len
    total = sum(q_len)
    bounds, target = [0], 1
    for seq, (start, length) in enumerate(zip(q_start, q_len)):
        # A sequence whose middle lies past the next part's share of the tokens starts that part.
        if len(bounds) < count and seq > 0 and start + length / 2 >= total * target / count:
            bounds.append(seq)
            target += 1
    bounds.append(len(q_len))
    index = lists.logits_index
    parts = []
    for first, end in zip(bounds, bounds[1:]):
        token_from = q_start[first]
        token_to = q_start[end - 1] + q_len[end - 1]
        rows = [row for row, token in enumerate(index) if token_from <= token < token_to]
        columns: dict[str, list | None] = {}
        for field in schema:
            values = lists.column(field.name)
            if values is None:
                columns[field.name] = None
            elif field.axis == TOKEN:
                columns[field.name] = values[token_from:token_to]
            elif field.axis == SEQUENCE:
                columns[field.name] = values[first:end]
            else:
                assert field.axis == LOGIT_ROW
                columns[field.name] = [values[row] for row in rows]
            if field.name in TOKEN_OFFSETS and values is not None:
                columns[field.name] = [value - token_from for value in columns[field.name]]
        parts.append(MicroBatch(StepLists(**columns), rows))
    return parts
