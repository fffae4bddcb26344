"""The detokenizer sends each request's outputs to the API server it came from (the origin its NEW
named), one OUTPUTS batch per API server per step; a REJECT to its request's API server alone."""

from __future__ import annotations

import os
from dataclasses import asdict

import zmq

from kiln.runtime.sampling import SamplingParams
from kiln.runtime.startup import StartupTimer
from kiln.server import ipc
from kiln.server.detokenizer_process import Detokenizer, run


def event(rid: str, token: int, finish: str | None = None) -> list:
    return [rid, 0, [token], [], finish, None, 3, 0, 0, 0, [], None]


def test_outputs_go_back_to_their_api_server():
    detokenizer = Detokenizer(None)
    params = asdict(SamplingParams(max_new_tokens=2))
    detokenizer.add("a", [1, 2], params, 0)
    detokenizer.add("b", [1, 2], params, 1)
    detokenizer.add("c", [1, 2], params, 1)
    step = detokenizer.outputs([event("a", 5), event("b", 6), event("c", 7, "length")])
    assert {origin: [output[0] for output in outputs] for origin, outputs in step.items()} == {0: ["a"], 1: ["b", "c"]}
    assert step[1][1][3] == [7] and step[1][1][5] == "length"
    assert list(detokenizer.outputs([event("b", 8, "length")])) == [1]


def test_a_reject_goes_to_the_api_server_its_add_came_from(tmp_path):
    """REJECT [rid, message, status, origin]: only the origin's inbox gets it; STATS reaches every one."""
    context = zmq.Context()
    inbox = ipc.pull_socket(context, ipc.address(tmp_path, ipc.DETOKENIZER_SOCKET))
    inboxes = [ipc.pull_socket(context, ipc.address(tmp_path, ipc.http_socket(j))) for j in range(2)]
    outboxes = [ipc.push_socket(context, ipc.address(tmp_path, ipc.http_socket(j))) for j in range(2)]
    scheduler = ipc.push_socket(context, ipc.address(tmp_path, ipc.DETOKENIZER_SOCKET))
    try:
        for message in ([ipc.REJECT, "r1", "temperature: must be >= 0", None, 1],
                        [ipc.REJECT, "r0", "the prefill server is unavailable", 503, 0],
                        [ipc.STATS, {"running": 0}, 0], [ipc.SHUTDOWN]):
            scheduler.send(ipc.pack(message))
        assert run(inbox, outboxes, ipc.ParentWatch(os.getppid()), None, StartupTimer("detokenizer")) == 0
        received = [[message[:2] for message in ipc.recv_ready(box, 2000)] for box in inboxes]
        assert received == [[[ipc.REJECT, "r0"], [ipc.STATS, {"running": 0}]],
                            [[ipc.REJECT, "r1"], [ipc.STATS, {"running": 0}]]]
    finally:
        for socket in (inbox, *inboxes, *outboxes, scheduler):
            socket.close(linger=0)
        context.term()
