"""The step schema end to end: a per-step input added in one place (``CompileOptions.step_fields``)
appears in the compiled graph's inputs, in the decode and prefill graphs' staged device buffers (its
values for real rows, its padding value for padding rows), and in the inputs the graph path hands
the program: on a CPU the padded path runs eagerly over the same static buffers a GPU captures
(tests/e2e/test_gpu.py checks a captured graph's)."""

from __future__ import annotations

import pytest
import torch

from kiln.ir import DType, TensorType
from kiln.runtime.artifact import load_artifact
from kiln.runtime.worker.decode_graphs import DecodeGraphs
from kiln.step_schema import SEQUENCE, STEP_SCHEMA, StepField
from tests.support.runners import cpu_runner
from tests.support.stepping import pages_for, step_lists

ADAPTER = StepField("adapter_index", SEQUENCE, -7, "a test input: which adapter each sequence uses")


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return cpu_runner(tmp_path_factory.mktemp("step_fields"), kv_cache_tokens=128, step_fields=(ADAPTER,))


@pytest.fixture(scope="module")
def artifact(runner):
    return runner.executor.artifact.path


def recorded_feeds(executor) -> list[dict[str, torch.Tensor]]:
    """Records the inputs each program run receives."""
    seen, step = [], executor.step_fn

    def recording(weights, feeds, arena, sizes):
        seen.append(dict(feeds))
        return step(weights, feeds, arena, sizes)

    executor.step_fn = recording
    return seen


def test_the_field_is_a_graph_input_and_in_the_manifest(artifact):
    loaded = load_artifact(artifact)
    assert loaded.step_schema == STEP_SCHEMA.with_fields(ADAPTER)
    graph_text = (artifact / "graph.txt").read_text()
    assert f"%adapter_index: {TensorType(('B',), DType.i32)}" in graph_text


def test_decode_graphs_stage_the_field_and_feed_it(runner):
    graphs = DecodeGraphs(runner.executor, runner.kv_views, [1, 2, 4], runner.executor.bounds["P"])
    seen = recorded_feeds(runner.executor)
    pages = pages_for([3, 2])
    lists = step_lists([1, 1], [2, 1], [0, 1], pages)
    lists.adapter_index = [5, 9]
    graphs.run(lists)
    region = graphs.layout.offset["adapter_index"]
    staged = graphs._devices[0][region:region + 2]
    assert staged.tolist() == [5, 9]
    fed = seen[-1]["adapter_index"]
    assert fed.tolist() == [5, 9] and fed.data_ptr() == staged.data_ptr()
    # Three sequences in the bucket of four: the padding row holds the field's padding value.
    lists = step_lists([1, 1, 1], [2, 1, 1], [0, 1, 2], pages_for([3, 2, 2]))
    lists.adapter_index = [1, 2, 3]
    graphs.run(lists)
    assert seen[-1]["adapter_index"].tolist() == [1, 2, 3, ADAPTER.pad]
    # Steps that leave the field out stage padding throughout.
    graphs.run(step_lists([1], [2], [0], pages_for([3])))
    assert seen[-1]["adapter_index"].tolist() == [ADAPTER.pad]


def test_prefill_graphs_stage_the_field_and_feed_it(runner):
    seen = recorded_feeds(runner.executor)
    lists = step_lists([5, 3, 2], [0, 0, 0], [0, 1, 2], pages_for([5, 3, 2]))
    lists.adapter_index = [4, 0, 8]
    runner.prefill_graphs.run(lists)
    fed = seen[-1]["adapter_index"]
    assert fed.tolist() == [4, 0, 8, ADAPTER.pad]  # three sequences in the bucket of four
    region = runner.prefill_graphs.layout.offset["adapter_index"]
    assert fed.data_ptr() == runner.prefill_graphs._device[region:].data_ptr()


def test_the_eager_path_feeds_the_field(runner):
    seen = recorded_feeds(runner.executor)
    lists = step_lists([2, 1], [0, 0], [0, 1], pages_for([2, 1]))
    runner.forward_eager(lists)
    assert seen[-1]["adapter_index"].tolist() == [ADAPTER.pad] * 2
    lists.adapter_index = [3, 1]
    runner.forward_eager(lists)
    assert seen[-1]["adapter_index"].tolist() == [3, 1]
