"""TokenReadback: a launched step's tokens reach the host through buffers used in turn, so reading
step N is not disturbed by step N+1's copy (on a GPU the copy is queued behind each step)."""

from __future__ import annotations

import pytest
import torch

from kiln.runtime.scheduler.batch import StepLists
from kiln.runtime.worker.token_readback import TokenReadback

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
EMPTY = StepLists.empty()


@pytest.mark.parametrize("device", DEVICES)
def test_two_steps_in_flight_keep_their_tokens(device):
    readback = TokenReadback(max_batch=8, device=torch.device(device))
    first = readback.launch(EMPTY, torch.tensor([5, 6, 7], device=device))
    second = readback.launch(EMPTY, torch.tensor([1, 2], device=device))
    assert first.host_tokens().tolist() == [5, 6, 7]
    assert second.host_tokens().tolist() == [1, 2]
    assert first.host_tokens().device.type == "cpu"
    third = readback.launch(EMPTY, torch.tensor([9], device=device))  # reuses the first buffer
    assert third.host_tokens().tolist() == [9] and second.host_tokens().tolist() == [1, 2]


@pytest.mark.parametrize("device", DEVICES)
def test_tokens_keep_their_dtype(device):
    # A graph's argmax gives int32 ids, the sampler int64: each is copied as it is, no conversion first.
    readback = TokenReadback(max_batch=4, device=torch.device(device))
    ids = readback.launch(EMPTY, torch.tensor([3, 4], dtype=torch.int32, device=device))
    sampled = readback.launch(EMPTY, torch.tensor([8], device=device))
    assert ids.host_tokens().dtype == torch.int32 and ids.host_tokens().tolist() == [3, 4]
    assert sampled.host_tokens().dtype == torch.int64 and sampled.host_tokens().tolist() == [8]


@pytest.mark.parametrize("device", DEVICES)
def test_a_mirror_the_step_wrote_is_read_as_it_is(device):
    # A decode graph's argmax writes its tokens to pinned host memory itself: nothing is copied, and
    # reading waits for the step (here: a device write queued before the launch).
    readback = TokenReadback(max_batch=4, device=torch.device(device))
    tokens = torch.tensor([4, 5], dtype=torch.int32, device=device)
    mirror = torch.zeros(2, dtype=torch.int32, pin_memory=device == "cuda")
    mirror.copy_(tokens, non_blocking=True)
    step = readback.launch(EMPTY, tokens, mirror)
    assert step.tokens is tokens and step.host_tokens() is mirror and mirror.tolist() == [4, 5]
