"""API server j of ``kiln serve --api-server-count N``, j >= 1: one more HTTP process on the port.

    python -m kiln.server.api_server_process '{"api_server": j, "listen_fd": FD, "serve": {ServeConfig},
                                               "tokenizer_dir": ..., "ipc_dir": ..., "parent_pid": ...,
                                               "api_servers": N, ...}'

The launcher (API server 0, ``launch.py``) starts it as the model starts loading, with its listening
socket (FD, inherited; see ``api_servers.py``) and the API key in the environment. It imports the
web stack and loads the tokenizer meanwhile, then waits for the replicas' facts (``MODELS``). It serves the
launcher's HTTP app (``http_process.run_http``) with its own tokenizer manager: its inbox is
``ipc.http_socket(j)``, it sends to the schedulers' inboxes and asks the other API servers what is
the server's (``peers.py``). It says READY to the launcher once it listens, drains on SIGTERM and
stops on SIGINT (the launcher passes both on), and stops when the launcher is gone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
from typing import Any, Callable

import zmq
import zmq.asyncio

from kiln.runtime.text.tokenizer import Tokenizer
from kiln.server import ipc
from kiln.server.api_servers import API_KEY_ENV, peer_sockets, samples_in_flight
from kiln.server.children import CHILD_POLL_S
from kiln.server.http_process import ProcessTies, run_event_loop, run_http
from kiln.server.serve_config import ServeConfig
from kiln.server.peers import Peers


def main(argv: list[str] | None = None) -> int:
    config = json.loads((argv if argv is not None else sys.argv[1:])[0])
    logging.basicConfig(level=config["log_level"].upper(),
                        format=f"kiln API server {config['api_server']}: %(message)s")
    # Until uvicorn's handlers take over, being told to stop ends this process at once.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: ipc.exit_now(0))
    serve_config = ServeConfig.from_json(config["serve"], os.environ.pop(API_KEY_ENV, None))
    return run_event_loop(_serve(config, serve_config))


async def _serve(config: dict[str, Any], serve_config: ServeConfig) -> int:
    me, count, ipc_dir = config["api_server"], config["api_servers"], config["ipc_dir"]
    context = zmq.Context()
    receiver = zmq.asyncio.Context.shadow(context.underlying).socket(zmq.PULL)
    receiver.setsockopt(zmq.LINGER, 0)
    receiver.bind(ipc.address(ipc_dir, ipc.http_socket(me)))
    senders = [ipc.push_socket(context, ipc.address(ipc_dir, ipc.scheduler_socket(i))) for i in range(serve_config.dp)]
    peers = Peers(me, peer_sockets(context, ipc_dir, me, count))
    listener = socket.socket(fileno=config["listen_fd"])
    launcher = ipc.ParentWatch(config["parent_pid"])

    async def watch_launcher(on_exit: Callable[[str], None]) -> None:
        while launcher.alive():
            await asyncio.sleep(CHILD_POLL_S)
        on_exit("the launching kiln serve process is gone")

    ties = ProcessTies([watch_launcher], listening=lambda: peers.tell(0, [ipc.READY, {"api_server": me}]))
    tokenizer = Tokenizer.from_dir(config["tokenizer_dir"]).prepare_for_requests() if config["tokenizer_dir"] else None
    try:
        facts = await _wait_models(receiver, launcher)
        if facts is None:
            return 0
        return await run_http(serve_config, facts, tokenizer, listener, receiver, senders, ties, peers,
                              samples_in_flight(ipc_dir, me, count))
    finally:
        listener.close()
        receiver.close()
        peers.close()
        for sender in senders:
            sender.close(linger=0)  # the server is stopping: an abort still queued has no one to free
        context.term()


async def _wait_models(receiver: zmq.asyncio.Socket, launcher: ipc.ParentWatch) -> list[dict[str, Any]] | None:
    """The replicas' facts, once the launcher has them (None: it is gone first). Nothing else it
    could be sent before then needs keeping: the only other traffic is the replicas' first STATS,
    whose figures the facts hold too."""
    while launcher.alive():
        if await receiver.poll(ipc.IDLE_POLL_MS):
            message = ipc.unpack(await receiver.recv())
            if message[0] == ipc.MODELS:
                return message[1]
    return None


if __name__ == "__main__":
    ipc.exit_now(main())
