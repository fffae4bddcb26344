"""The step's side stream: nothing to fork on a CPU; on a GPU a side op runs beside the main stream and
the join orders what reads its output after it."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.triton_support import semaphore_counters
from kiln.runtime.worker.step_streams import StepStreams


def test_on_a_cpu_side_work_runs_in_program_order():
    streams, order = StepStreams(torch.device("cpu")), []
    with streams.side():
        order.append("side")
    order.append("main")
    streams.join()
    assert order == ["side", "main"]


@pytest.mark.gpu
@pytest.mark.parametrize("enabled", [True, False])
def test_the_join_orders_a_side_result_before_its_reader(enabled):
    """A long side kernel (a large matmul) writes h; the main stream's reader after the join sees all of
    it, eagerly and replayed from a CUDA graph captured with the fork and join."""
    device = torch.device("cuda")
    streams = StepStreams(device, enabled)
    x = torch.randn(4096, 4096, device=device)
    h = torch.zeros(4096, 4096, device=device)
    out = torch.empty(4096, 4096, device=device)

    def step():
        with streams.side():
            torch.matmul(x, x, out=h)
            semaphore_counters(device, 1)  # the side lane's counters exist before any capture
        streams.join()
        torch.mul(h, 2, out=out)

    step()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, 2 * (x @ x))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, 2 * (x @ x))
