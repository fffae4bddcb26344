"""An ADD's optional parts travel by name (``ipc.AddOptions``): a field at its default is left off the
wire, and what is sent reads back the same, the sending API server (origin) included."""

from __future__ import annotations

from kiln.server import ipc


def test_add_options_send_only_what_is_set_and_read_back_the_same():
    assert ipc.AddOptions().to_wire() == {}
    options = ipc.AddOptions(lora="sql", bootstrap={"room": 7, "host": "10.0.0.2", "port": 8998}, origin=1)
    wire = ipc.unpack(ipc.pack([ipc.ADD, options.to_wire()]))[1]
    assert wire == {"lora": "sql", "bootstrap": {"room": 7, "host": "10.0.0.2", "port": 8998}, "origin": 1}
    assert ipc.AddOptions.from_wire(wire) == options
    assert ipc.AddOptions.from_wire({"lora": "sql"}) == ipc.AddOptions(lora="sql", origin=0)
