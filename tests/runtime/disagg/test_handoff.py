"""Prefill/decode disaggregation at the engine level, in real processes on the CPU: a prefill engine in
its own process prefills batches of prompts and hands their KV pages over a ``KVLink`` (gloo) to a
decode engine in this process, which then answers them with the plain engine's tokens (greedy,
prompts of several lengths: shorter than a page, whole pages, longer, decoded together), computing
only each prompt's last partial page itself (its prefix-cache hits count the handed-over tokens).
The prefill side's own prefix cache still works (a second batch sharing the first's passage hits
it). A prefill process that dies makes the decode side's receive fail with a clear error, not hang;
so does a decode side that is gone for the prefill side's send. With two GPUs, the same with the
prefill engine on one and the decode engine on the other, the pages going over the link's NCCL group
(skipped without two GPUs)."""

from __future__ import annotations

import multiprocessing
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.runtime.disagg.handoff import import_prompt, prefill_and_hand_off, receive_prompt
from kiln.runtime.disagg.kv_link import Handoff, KVLink, KVLinkError
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.engine_options import EngineOptions
from kiln.runtime.sampling import SamplingParams
from tests.server.harness import free_port
from tests.support.hf_models import make_hf_model

PAGE = 4
PASSAGE = [11, 12, 13, 14, 15, 16, 17, 18, 19]
FIRST = {0: [1, 5, 9, 33, 2, 7, 100], 1: [3, 4], 2: [*PASSAGE, 40, 41], 3: [20, 21, 22, 23, 24, 25, 26, 27]}
SECOND = {4: [*PASSAGE, 50, 51, 52], 5: [*PASSAGE, 60]}
PARAMS = dict(temperature=0, max_new_tokens=6, ignore_eos=True)
ENGINE = dict(device="cpu", kv_cache_tokens=512)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("disagg")
    return compile_model(make_hf_model("llama3", tmp / "src"), tmp / "m.kiln", CompileOptions(
        dtype="fp32", page_size=PAGE, max_batch_tokens=64, max_batch_size=16, max_seq_len=64))


def run(core: EngineCore, prompts: dict[int, list[int]]) -> dict[int, list[int]]:
    for room, prompt in prompts.items():
        core.add_request(str(room), prompt, SamplingParams(**PARAMS))
    tokens: dict[int, list[int]] = {room: [] for room in prompts}
    while core.has_work():
        for event in core.step():
            tokens[int(event.rid)] += event.token_ids
    return tokens


def prefill_side(artifact: str, port: int, batches: list[dict[int, list[int]]], report, device: str = "cpu") -> None:
    """The prefill process: hands every batch over, then reports its prefix-cache hits per batch."""
    core = EngineCore(artifact, EngineOptions(**{**ENGINE, "device": device}))
    link = KVLink.prefill(KVLink.listen("127.0.0.1", port), device=core.runner.pool.device)
    hits = []
    for batch in batches:
        before = core.stats()["cache_hit_tokens"]
        prefill_and_hand_off(core, link, batch)
        hits.append(core.stats()["cache_hit_tokens"] - before)
    report.send(hits)


def test_prefill_in_another_process_then_decode_gives_the_plain_engines_tokens(artifact):
    check_prefill_then_decode(artifact, "cpu", "cpu")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_prefill_on_one_gpu_hands_pages_over_nccl_to_decode_on_another(artifact):
    """The KV goes GPU to GPU (the link's NCCL group): prefill on cuda:0, decode on cuda:1."""
    link = check_prefill_then_decode(artifact, "cuda:0", "cuda:1")
    assert link.device_group is not None


def check_prefill_then_decode(artifact: Path, prefill_device: str, decode_device: str) -> KVLink:
    """A prefill engine in another process on ``prefill_device`` hands two batches over to a decode engine
    here on ``decode_device``: the plain engine's tokens, the handed pages reused. Returns the decode link."""
    expected = run(EngineCore(str(artifact), EngineOptions(**{**ENGINE, "device": decode_device})),
                   {**FIRST, **SECOND})
    context = multiprocessing.get_context("spawn")
    reader, writer = context.Pipe(duplex=False)
    port = free_port()
    prefill = context.Process(target=prefill_side, args=(str(artifact), port, [FIRST, SECOND], writer, prefill_device),
                              daemon=True)
    prefill.start()
    try:
        decode = EngineCore(str(artifact), EngineOptions(**{**ENGINE, "device": decode_device}))
        link = KVLink.decode("127.0.0.1", port, device=decode.runner.pool.device)
        for batch in (FIRST, SECOND):
            handed = {(h := receive_prompt(decode, link)).room: h for _ in batch}
            assert {room: len(h.token_ids) for room, h in handed.items()} == \
                {room: len(p) // PAGE * PAGE for room, p in batch.items()}
            before = decode.stats()["cache_hit_tokens"]
            assert run(decode, batch) == {room: expected[room] for room in batch}
            # Every handed-over page was reused, except a prompt's last page when it is whole (one
            # token is always left to compute the first token's logits from).
            reused = sum(len(h.token_ids) - PAGE * (len(batch[r]) % PAGE == 0) for r, h in handed.items())
            assert decode.stats()["cache_hit_tokens"] - before == reused
        hits = reader.recv()
        # The prefill side: the second batch found the first batch's passage (two whole pages) in its cache.
        assert hits[0] == 0 and hits[1] >= 2 * (len(PASSAGE) // PAGE * PAGE)
        prefill.join(30)
        assert prefill.exitcode == 0
        return link
    finally:
        prefill.kill()


def sleeping_prefill(port: int) -> None:
    KVLink.prefill(KVLink.listen("127.0.0.1", port))
    multiprocessing.Event().wait()  # never sends; killed by the test


def test_a_dead_prefill_side_fails_the_decode_sides_receive(artifact):
    context = multiprocessing.get_context("spawn")
    port = free_port()
    prefill = context.Process(target=sleeping_prefill, args=(port,), daemon=True)
    prefill.start()
    link = KVLink.decode("127.0.0.1", port, timeout=timedelta(seconds=30))
    prefill.kill()
    with pytest.raises(KVLinkError, match="the KV handoff to the prefill side failed"):
        link.receive()


def test_a_handoff_from_another_artifact_is_refused(artifact):
    core = EngineCore(str(artifact), EngineOptions(**ENGINE))
    with pytest.raises(ValueError, match="are both sides serving the same artifact"):
        import_prompt(core, Handoff(0, [1, 2, 3, 4], torch.zeros(1, 2, 4, 1, 1)))


def sleeping_decode(port: int) -> None:
    KVLink.decode("127.0.0.1", port)
    multiprocessing.Event().wait()  # never receives; killed by the test


def test_a_dead_decode_side_fails_the_prefill_sides_send():
    context = multiprocessing.get_context("spawn")
    port = free_port()
    decode = context.Process(target=sleeping_decode, args=(port,), daemon=True)
    decode.start()
    link = KVLink.prefill(KVLink.listen("127.0.0.1", port), timeout=timedelta(seconds=30))
    decode.kill()
    decode.join()
    with pytest.raises(KVLinkError, match="the KV handoff to the decode side failed"):
        link.send(Handoff(0, list(range(8)), torch.zeros(2, 2, 8, 2, 16)))


def test_a_taken_bootstrap_port_fails_at_once_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(KVLinkError, match=f"cannot listen for the decode side on 127.0.0.1:{port}"):
            KVLink.listen("127.0.0.1", port)


def test_a_decode_side_with_no_prefill_side_gives_up_after_its_connect_timeout():
    port = free_port()
    started = time.monotonic()
    with pytest.raises(KVLinkError, match=f"cannot reach the prefill side's bootstrap port 127.0.0.1:{port}"):
        KVLink.decode("127.0.0.1", port, connect_timeout=timedelta(seconds=2))
    assert time.monotonic() - started < 30
