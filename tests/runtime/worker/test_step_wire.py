"""The step's lists on the wire: every column but the host-only attributes comes back equal, through
msgpack, whichever columns the step fills."""

from __future__ import annotations

from kiln.runtime.scheduler.batch import StepLists
from kiln.runtime.worker.step_wire import decode, encode


def test_every_column_but_the_host_objects_round_trips():
    columns = dict(token_ids=[5, 9, 2, 7], positions=[3, 0, 1, 2], slots=[11, 16, 17, 18], q_start=[0, 1],
                   q_len=[1, 3], kv_len=[4, 3], page_table=[[2], [4, 5]], logits_index=[0, 3])
    lists = StepLists([object(), object()], **columns)
    assert decode(encode(lists)) == StepLists([], **columns)


def test_a_column_the_step_leaves_out_stays_out():
    lists = StepLists([], token_ids=[1], positions=[0])
    back = decode(encode(lists))
    assert back.column("token_ids") == [1] and back.column("slots") is None
