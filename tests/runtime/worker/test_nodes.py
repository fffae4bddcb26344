"""Two "nodes" on loopback (``kiln serve A --nnodes 2 --node-rank R --dist-init-addr 127.0.0.1:P``,
two real server processes): a tp=2 artifact with one rank on each node answers with the tokens of
one node at tp=2 and of the one-rank artifact; killing the second node ends the server, naming the
node, with no process left on either side. Every process on both nodes, started from an environment
without them, has NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (multicast stays off).
Plus the layout checks' messages."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.engine_options import EngineOptions
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.worker.nodes import NODE_TIMEOUT_S, check_layout, parse_addr
from kiln.runtime.worker.nccl_env import MULTICAST_OFF
from tests.server.harness import ServerProcess, children_of, environ_of, free_port, wait_gone
from tests.support.hf_models import make_hf_model

PROMPTS = [[1, 5, 9, 33, 2, 7, 100], [3, 4], [200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 210]]
PARAMS = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
OPTIONS = dict(dtype="fp32", page_size=4, max_batch_tokens=64, max_batch_size=16, max_seq_len=64)
# The dead node's heartbeat is missed for NODE_TIMEOUT_S, then the server fails and exits.
EXIT_BOUND_S = NODE_TIMEOUT_S + 20.0


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("nodes")
    source = make_hf_model("llama3", tmp / "src")
    return (compile_model(source, tmp / "tp1.kiln", CompileOptions(**OPTIONS)),
            compile_model(source, tmp / "tp2.kiln", CompileOptions(**OPTIONS, tp=2)))


def engine_tokens(artifact: Path, **options) -> list[list[int]]:
    core = EngineCore(str(artifact), EngineOptions(device="cpu", kv_cache_tokens=1024, **options))
    try:
        for index, prompt in enumerate(PROMPTS):
            core.add_request(str(index), prompt, SamplingParams(**PARAMS))
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
        while core.has_work():
            for event in core.step():
                tokens[event.rid] += event.token_ids
        return [tokens[str(i)] for i in range(len(PROMPTS))]
    finally:
        core.close()


def test_two_loopback_nodes_answer_as_one_and_end_when_the_second_dies(artifacts, tmp_path, monkeypatch):
    tp1, tp2 = artifacts
    expected = engine_tokens(tp1)
    assert engine_tokens(tp2) == expected  # one node at tp=2
    for name in MULTICAST_OFF:  # the servers' processes get them from kiln, not from this process
        monkeypatch.delenv(name, raising=False)
    addr = f"127.0.0.1:{free_port()}"
    layout = ["--nnodes", "2", "--dist-init-addr", addr]
    # Node 1 first: it waits for node 0's rendezvous.
    log1 = open(tmp_path / "node1.log", "wb")
    node1 = subprocess.Popen([sys.executable, "-m", "kiln", "serve", str(tp2), "--device", "cpu", *layout,
                              "--node-rank", "1"], stdout=log1, stderr=subprocess.STDOUT)
    server = ServerProcess(tp2, tmp_path / "node0.log", *layout, "--node-rank", "0", api_key=None)
    try:
        server.wait_healthy()
        for prompt, tokens in zip(PROMPTS, expected):
            reply = httpx.post(f"{server.url}/generate", json={"input_ids": prompt, "sampling_params": PARAMS},
                               timeout=120)
            assert reply.status_code == 200 and reply.json()["output_ids"] == tokens
        node1_children = children_of(node1.pid)
        assert sum(b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes() for pid in node1_children) == 1
        node0 = [*server.child_pids(), *(p for c in server.child_pids() for p in children_of(c))]
        # The processes kiln started (/proc shows the environment a process was started with).
        for pid in [*node0, *node1_children]:
            assert {name: environ_of(pid).get(name) for name in MULTICAST_OFF} == MULTICAST_OFF, pid
        os.kill(node1.pid, signal.SIGKILL)
        assert server.proc.wait(EXIT_BOUND_S) != 0
        assert "node 1 (ranks 1..1) stopped answering" in server.log()
        assert wait_gone([*node1_children, *node0], 10) == []
    finally:
        node1.kill()
        node1.wait()
        log1.close()
        server.proc.kill()
        server.stop()


def test_pipeline_stages_on_two_nodes_answer_as_one_rank(artifacts, tmp_path):
    """pp=2 with one stage on each node (node 0: rank 0, stage 0; node 1: rank 1, stage 1): an engine
    on node 0, node 1 a ``kiln serve --node-rank 1`` process; the tokens of the one-rank artifact."""
    tp1, _ = artifacts
    pp2 = compile_model(tp1.parent / "src", tmp_path / "pp2.kiln", CompileOptions(**OPTIONS, pp=2))
    expected = engine_tokens(tp1)
    addr = f"127.0.0.1:{free_port()}"
    with open(tmp_path / "node1.log", "wb") as log1:
        node1 = subprocess.Popen([sys.executable, "-m", "kiln", "serve", str(pp2), "--device", "cpu", "--nnodes", "2",
                                  "--dist-init-addr", addr, "--node-rank", "1"], stdout=log1, stderr=subprocess.STDOUT)
        try:
            assert engine_tokens(pp2, nnodes=2, dist_init_addr=addr) == expected
            assert node1.wait(30) == 0  # the engine closed: its stage got the stop message
        finally:
            node1.kill()
            node1.wait()


def test_a_stopped_server_stops_the_other_node(artifacts, tmp_path):
    _, tp2 = artifacts
    addr = f"127.0.0.1:{free_port()}"
    layout = ["--nnodes", "2", "--dist-init-addr", addr]
    server = ServerProcess(tp2, tmp_path / "node0.log", *layout, api_key=None)
    with open(tmp_path / "node1.log", "wb") as log1:
        node1 = subprocess.Popen([sys.executable, "-m", "kiln", "serve", str(tp2), "--device", "cpu", *layout,
                                  "--node-rank", "1"], stdout=log1, stderr=subprocess.STDOUT)
        try:
            server.wait_healthy()
            assert server.stop() == 0
            assert node1.wait(30) == 0  # its rank got node 0's stop message
        finally:
            node1.kill()
            node1.wait()
            server.proc.kill()


@pytest.mark.parametrize("args, message", [
    ((2, 3, 0, "h:1"), "the ranks (pp x max(tp, ep)) must be a multiple of --nnodes"),
    ((2, 2, 2, "h:1"), "node_rank: must be in 0..1"),
    ((2, 2, 0, None), "dist_init_addr: nnodes > 1 needs"),
    ((2, 2, 0, "host"), "expected HOST:PORT"),
    ((2, 0, 0, None), "nnodes: must be at least 1"),
])
def test_bad_layouts_are_refused_by_name(args, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_layout(*args)


def test_addresses_parse_with_ipv6_brackets():
    assert parse_addr("10.0.0.1:5000") == ("10.0.0.1", 5000)
    assert parse_addr("[::1]:5000") == ("::1", 5000)
