"""Prefill and mixed steps as CUDA graphs, one per (token bucket, sequence bucket), captured on first use.

Run op by op, a prefill step is bound by the host: each of its ~14 kernels a layer costs ~50 µs of
Python and driver time to launch, so SmolLM2-135M's 128-token prefill took 21.7 ms on an H200 whose
GPU was busy for 1.0 ms of it (bench/experiments/prefill_breakdown.py). Replayed from a graph, it costs one
launch. A step of ``t`` tokens over ``b`` sequences runs as the graph of the smallest token bucket
``T >= t``, sequence bucket ``B >= b`` and logits-row bucket ``N >= n`` (the sequence bucket
unless the step wants more rows than sequences, as draft verification does): the step's index lists
are staged into a pinned host buffer laid out by the step schema (``step_buffers.StepLayout``) and
copied to the device in one transfer; padding rows hold each field's padding value, so tokens
``t..T`` store no KV and are in no sequence (attention leaves their rows alone) and sequences
``b..B`` have no new tokens (attention skips them). ``max_q_len`` is the token bucket and
``max_kv_len`` the page table's reach, bounds that hold for any step the graph serves; attention's
loops over each sequence's own lengths read them from the device.

Buckets are powers of two (from 16 tokens and 1 sequence) up to the artifact's bounds, so there are
many; a graph is captured the first time a step needs it (a warm-up run, which compiles any
Triton kernel at those sizes, then the capture), or earlier, one at a time, while a server has nothing
to do (``uncaptured``, ``EngineCore.warm_up_idle``), and kept. All of them share the executor's arena,
one memory pool for their temporaries, and the static inputs. On a CPU (no graphs) the same padded
path runs eagerly; tests use it to check that padding changes nothing.
"""

from __future__ import annotations

import torch

from kiln.step_schema import TOKEN

from ..scheduler.batch import StepLists
from .executor import Executor, StepInputs, StepResult
from .expert_load import counted_once
from .graph_capture import WARMUP_RUNS, capture_graph
from .step_buffers import StepLayout

MIN_TOKEN_BUCKET = 16


def bucket_sizes(least: int, bound: int) -> list[int]:
    """Powers of two from ``least`` below ``bound``, then ``bound`` itself."""
    sizes = []
    size = least
    while size < bound:
        sizes.append(size)
        size *= 2
    return sizes + [bound]


def _graph_key(sizes: dict[str, int]) -> tuple[int, int, int]:
    return sizes["T"], sizes["B"], sizes["N"]


class PrefillGraphs:
    def __init__(self, executor: Executor, kv_views: dict[str, torch.Tensor], bounds: dict[str, int]) -> None:
        """``bounds``: the most tokens (T), sequences (B) and logits rows (N) of a step, and the page
        table's width (P)."""
        self.executor = executor
        self.kv_views = kv_views
        self.token_buckets = bucket_sizes(min(MIN_TOKEN_BUCKET, bounds["T"]), bounds["T"])
        self.sequence_buckets = bucket_sizes(1, bounds["B"])
        self.row_buckets = bucket_sizes(1, bounds["N"])
        self.layout = StepLayout(executor.schema, {axis: bounds[axis] for axis in ("T", "B", "N")}, bounds["P"])
        device = executor.device
        self._capturing = device.type == "cuda"
        # Two pinned staging buffers used in turn, as DecodeGraphs does: a step may be staged while
        # the previous step's copy is still in flight.
        self._hosts = [torch.zeros(self.layout.size, dtype=torch.int32, pin_memory=self._capturing) for _ in range(2)]
        self._turn = 0
        self._device = torch.zeros(self.layout.size, dtype=torch.int32, device=device)
        self._graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self._capturing else None

    def fits(self, lists: StepLists) -> bool:
        """A step within the largest buckets."""
        return len(lists.token_ids) <= self.token_buckets[-1] and len(lists.q_len) <= self.sequence_buckets[-1] \
            and len(lists.logits_index) <= self.row_buckets[-1] \
            and all(len(row) <= self.layout.width for row in lists.page_table)

    def run(self, lists: StepLists) -> StepResult:
        """The step's outputs, a row for each of ``lists.logits_index`` (per-token outputs: for each
        token) (views valid until the next step)."""
        n = len(lists.logits_index)
        sizes = self._buckets(len(lists.token_ids), len(lists.q_len), n)
        inputs = self._stage(lists, sizes)
        if not self._capturing:
            outputs = self.executor.run(inputs, self.kv_views)
        else:
            key = _graph_key(sizes)
            if key not in self._graphs:
                self._graphs[key] = self._capture(inputs)
            graph, outputs = self._graphs[key]
            graph.replay()
        per_token = {o.name for o in self.executor.schema.outputs if o.axis == TOKEN}
        tokens = len(lists.token_ids)
        return StepResult({name: value[:tokens if name in per_token else n] for name, value in outputs.items()}, None)

    def warm_up_buckets(self) -> list[tuple[int, int]]:
        """The (token, sequence) buckets of prefill and mixed steps (more tokens than sequences, a
        logits row each), smallest first: what an idle server captures ahead of the traffic that
        would otherwise wait for the captures (``warm_up_lists``). Buckets no step can reach (a
        sequence longer than the page table) are left out."""
        reach = self.layout.width * self.executor.page_size
        return [(t, b) for t in self.token_buckets for b in self.sequence_buckets
                if b < t and b <= self.row_buckets[-1] and -(-t // b) <= reach]

    def uncaptured(self) -> list[tuple[int, int]]:
        """``warm_up_buckets`` with no graph yet (none on a CPU, which captures nothing)."""
        if not self._capturing:
            return []
        return [(t, b) for t, b in self.warm_up_buckets() if _graph_key(self._buckets(t, b, b)) not in self._graphs]

    def warm_up_lists(self, bucket: tuple[int, int]) -> StepLists:
        """A step of ``bucket = (tokens, sequences)``: the tokens split evenly over the sequences (the first
        ones a token more), a logits row each, that stores nothing: every K/V slot is -1 and every context
        is on page 0, as padding sequences' are. Run, it takes the graph of that bucket."""
        tokens, sequences = bucket
        lengths = [tokens // sequences + (i < tokens % sequences) for i in range(sequences)]
        starts = [sum(lengths[:i]) for i in range(sequences)]
        return StepLists(token_ids=[0] * tokens, positions=[p for n in lengths for p in range(n)],
                         slots=[-1] * tokens, q_start=starts, q_len=lengths, kv_len=lengths,
                         page_table=[[0] * -(-n // self.executor.page_size) for n in lengths],
                         logits_index=[start + n - 1 for start, n in zip(starts, lengths)])

    def _buckets(self, t: int, b: int, n: int) -> dict[str, int]:
        sequences = next(s for s in self.sequence_buckets if s >= b)
        # One logits row a sequence at most (prefill, decode): the sequence bucket serves, and no
        # extra graphs are captured; more rows (a request verifying drafts) take a row bucket.
        rows = sequences if n <= sequences <= self.row_buckets[-1] else next(r for r in self.row_buckets if r >= n)
        return {"T": next(s for s in self.token_buckets if s >= t), "B": sequences, "N": rows}

    def _stage(self, lists: StepLists, sizes: dict[str, int]) -> StepInputs:
        """Writes the step padded to the bucket into the pinned buffer and copies what the bucket
        reads to the device in one transfer."""
        host = self._hosts[self._turn]
        self._turn ^= 1
        layout = self.layout
        layout.write_vectors(host, lists, sizes, [f.name for f in layout.schema if f.columns is None])
        for table in layout.schema.tables():
            layout.write_table(host, table, lists.column(table.name) or [])
        used = layout.end(sizes)
        self._device[:used].copy_(host[:used], non_blocking=True)
        # max_q_len is the token bucket and max_kv_len the page table's reach: bounds that hold for
        # any step the graph serves.
        return StepInputs(layout.views(self._device, sizes), max_q_len=sizes["T"],
                          max_kv_len=layout.width * self.executor.page_size)

    def _capture(self, inputs: StepInputs) -> tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]]:
        # The staged step is real: the warm-up runs compute it (storing its K/V), and the replay that
        # follows the capture computes it again, identically.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), counted_once(self.kv_views):
            for _ in range(WARMUP_RUNS):  # Triton compiles and autotunes outside the capture
                self.executor.run(inputs, self.kv_views)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with capture_graph(graph, self._pool):
            outputs = self.executor.run(inputs, self.kv_views)
        return graph, outputs
