"""An ADD's optional parts travel by name (``ipc.AddOptions``): a field at its default is left off the
wire, and what is sent reads back the same, the sending API server (origin) included. Engine events
read back as the detokenizer unpacks them, with and without logprobs."""

from __future__ import annotations

from kiln.runtime.outputs import SampleEvent, TokenLogprob
from kiln.server import ipc


def test_add_options_send_only_what_is_set_and_read_back_the_same():
    assert ipc.AddOptions().to_wire() == {}
    options = ipc.AddOptions(lora="sql", bootstrap={"room": 7, "host": "10.0.0.2", "port": 8998}, origin=1)
    wire = ipc.unpack(ipc.pack([ipc.ADD, options.to_wire()]))[1]
    assert wire == {"lora": "sql", "bootstrap": {"room": 7, "host": "10.0.0.2", "port": 8998}, "origin": 1}
    assert ipc.AddOptions.from_wire(wire) == options
    assert ipc.AddOptions.from_wire({"lora": "sql"}) == ipc.AddOptions(lora="sql", origin=0)


def test_events_cross_the_wire_as_the_detokenizer_reads_them():
    # With logprobs the records become arrays; without, the NamedTuple itself is packed: both read
    # back as the same flat list of the event's fields, in order.
    scored = SampleEvent("r", 1, (5, 6), (TokenLogprob(5, -0.5, ((7, -1.0),)), TokenLogprob(6, -0.25)), "stop",
                         None, 3, 1, 2, 4, (-0.125,), "x")
    plain = SampleEvent("s", 0, (9,), prompt_tokens=3)
    wire = ipc.unpack(ipc.pack([ipc.EVENTS, [ipc.event_to_wire(scored), ipc.event_to_wire(plain)]]))[1]
    assert wire[0] == ["r", 1, [5, 6], [[5, -0.5, [[7, -1.0]]], [6, -0.25, []]], "stop", None, 3, 1, 2, 4,
                       [-0.125], "x"]
    assert wire[1] == ["s", 0, [9], [], None, None, 3, 0, 0, 0, [], None]
