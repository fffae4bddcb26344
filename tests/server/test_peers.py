"""The API servers' questions to one another over real ipc:// ZMQ sockets: every other one answers,
an unknown kind is left to the tokenizer manager, READY is counted, and one that does not answer
makes the question a 503 naming it."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from kiln.server import ipc
from kiln.server.api_servers import peer_sockets
from kiln.server.errors import APIError
from kiln.server.peers import Peers


def test_every_other_api_server_answers_and_ready_is_counted(tmp_path):
    async def run() -> None:
        context = zmq.asyncio.Context()
        inboxes = [context.socket(zmq.PULL) for _ in range(3)]
        for index, inbox in enumerate(inboxes):
            inbox.bind(ipc.address(tmp_path, ipc.http_socket(index)))
        peers = [Peers(me, peer_sockets(context, str(tmp_path), me, 3), timeout_s=5) for me in range(3)]
        for me, peer in enumerate(peers):
            peer.answer("square", lambda x, me=me: [me, x * x])
        others: list[list] = []

        async def receive(me: int) -> None:
            while True:
                message = ipc.unpack(await inboxes[me].recv())
                if not peers[me].handle(message):
                    others.append(message)

        loops = [asyncio.ensure_future(receive(me)) for me in range(3)]
        try:
            assert sorted(await peers[1].ask_all("square", 7)) == [[0, 49], [2, 49]]
            peers[2].tell(0, [ipc.READY, {"api_server": 2}])
            peers[1].tell(0, [ipc.STATS, {"running": 1}, 0])
            await asyncio.sleep(0.2)
            assert peers[0].ready == {2} and others == [[ipc.STATS, {"running": 1}, 0]]
            assert await Peers().ask_all("square", 1) == []  # alone: no one to ask
        finally:
            for loop in loops:
                loop.cancel()
            for peer in peers:
                peer.close()
            for inbox in inboxes:
                inbox.close()
            context.term()

    asyncio.run(run())


def test_an_api_server_that_does_not_answer_makes_a_503(tmp_path):
    async def run() -> None:
        context = zmq.asyncio.Context()
        silent = context.socket(zmq.PULL)
        silent.bind(ipc.address(tmp_path, ipc.http_socket(1)))  # bound, never read
        peers = Peers(0, peer_sockets(context, str(tmp_path), 0, 2), timeout_s=0.2)
        try:
            with pytest.raises(APIError, match="1 of the other API servers did not answer 'metrics'") as error:
                await peers.ask_all("metrics")
            assert error.value.status == 503
        finally:
            peers.close()
            silent.close()
            context.term()

    asyncio.run(run())
