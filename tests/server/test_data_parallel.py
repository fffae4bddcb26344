"""``kiln serve --dp 2`` with the real SmolLM2 on the CPU: two replicas behind one endpoint.

A shared-prefix workload (two groups of prompts, each group sharing a long passage) sends each
group to one replica, which the router's per-replica counts and prefix hit rate and each replica's
own prefix-cache hits in /metrics show; the answers are the one-replica server's (the session's
shared server), token for token under greedy decoding. Killing one replica's scheduler ends the
whole server within 5 s with no process left.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import openai
import pytest

from tests.server.harness import API_KEY, MODEL, ServerProcess, metrics, started_by, wait_gone

PASSAGES = [
    "The river Loire rises in the Massif Central and flows north and then west for more than a thousand "
    "kilometres, past Orleans, Blois, Tours and Nantes, before it reaches the Atlantic Ocean at Saint-Nazaire. "
    "Its valley is known for castles, vineyards and wide sandbanks.",
    "A sourdough starter is a mixture of flour and water in which wild yeast and lactic acid bacteria grow. "
    "Bakers feed it every day with fresh flour and water, keep part of it for the next loaf, and use the rest "
    "to leaven bread that tastes slightly sour.",
]
QUESTIONS = ["Question: What is this text about? Answer:", "Question: Name one detail. Answer:",
             "Question: Summarise it in three words. Answer:"]


@pytest.fixture(scope="module")
def dp_server(smollm2_artifact, tmp_path_factory):
    with ServerProcess(smollm2_artifact, tmp_path_factory.mktemp("dp") / "serve.log", "--dp", "2") as process:
        yield process


def complete(client: openai.OpenAI, prompt: str) -> str:
    # A generous timeout: on a busy 2-core CI machine a CPU step can take seconds.
    return client.with_options(timeout=600).completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                                               temperature=0).choices[0].text


def test_each_prefix_group_goes_to_one_replica_and_answers_as_one_replica_does(dp_server, client):
    dp_client = openai.OpenAI(base_url=f"{dp_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    prompts = [f"{passage}\n{question}" for question in QUESTIONS for passage in PASSAGES]
    answers = [complete(dp_client, prompt) for prompt in prompts]
    assert answers == [complete(client, prompt) for prompt in prompts]

    seen = metrics(dp_server)
    print({k: v for k, v in seen.items() if "replica" in k or "router" in k})
    assert seen['kiln_dp_requests_total{replica="0"}'] == 3 and seen['kiln_dp_requests_total{replica="1"}'] == 3
    assert seen['kiln_dp_requests_in_flight{replica="0"}'] == 0
    # The two later prompts of each group find all but their question in the replica they go to.
    assert seen["kiln_router_prefix_hit_rate"] > 0.5
    # ... and that replica's own radix cache has the passage: each group reused its prefix where it went.
    for replica in ("0", "1"):
        assert seen[f'kiln_prefix_cache_hit_tokens_total{{replica="{replica}"}}'] >= 2 * 32
    assert seen["kiln_prefix_cache_hit_tokens_total"] == sum(
        seen[f'kiln_prefix_cache_hit_tokens_total{{replica="{r}"}}'] for r in ("0", "1"))


def test_killing_one_replica_ends_the_server_within_5_s_with_no_orphans(dp_server):
    # Runs after the workload test (it ends the module's server).
    children = dp_server.child_pids()
    assert len(children) == 3  # two schedulers and the detokenizer

    def replica_of(pid: int) -> int | None:
        argv = [a for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
        return json.loads(argv[-1]).get("replica")

    victim = next(pid for pid in children if replica_of(pid) == 1)
    os.kill(victim, signal.SIGKILL)
    assert dp_server.proc.wait(5) != 0
    assert wait_gone(children, 5) == [] and started_by(dp_server.proc.pid) == []
    assert "the replica 1 scheduler process exited unexpectedly" in dp_server.log()
