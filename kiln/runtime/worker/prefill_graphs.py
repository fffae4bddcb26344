"""Prefill and mixed steps as CUDA graphs, one per (token bucket, sequence bucket), captured on first use.

Run op by op, a prefill step is bound by the host: each of its ~14 kernels a layer costs ~50 µs of
Python and driver time to launch, so SmolLM2-135M's 128-token prefill took 21.7 ms on an H200 whose
GPU was busy for 1.0 ms of it (bench/experiments/prefill_breakdown.py). Replayed from a graph, it costs one
launch. A step of ``t`` tokens over ``b`` sequences runs as the graph of the smallest token bucket
``T >= t`` and sequence bucket ``B >= b``: the step's index lists are packed into a pinned host
buffer and copied to the device in one transfer; tokens ``t..T`` are padding (token 0, position 0,
KV slot -1 so nothing is stored, in no sequence, so attention leaves their rows alone) and sequences
``b..B`` have no new tokens (attention skips them). ``max_q_len`` is the token bucket and
``max_kv_len`` the page table's reach, bounds that hold for any step the graph serves; attention's
loops over each sequence's own lengths read them from the device.

Buckets are powers of two (from 16 tokens and 1 sequence) up to the artifact's bounds, so there are
many; a graph is captured the first time a step needs it (two warm-up runs, which compile any
Triton kernel at those sizes, then the capture), and kept. All of them share the executor's arena,
one memory pool for their temporaries, and the static inputs. On a CPU (no graphs) the same padded
path runs eagerly; tests use it to check that padding changes nothing.
"""

from __future__ import annotations

import torch

from ..scheduler.batch import StepLists
from .decode_graphs import as_int_tensor
from .executor import Executor, StepInputs

MIN_TOKEN_BUCKET = 16


def bucket_sizes(least: int, bound: int) -> list[int]:
    """Powers of two from ``least`` below ``bound``, then ``bound`` itself."""
    sizes = []
    size = least
    while size < bound:
        sizes.append(size)
        size *= 2
    return sizes + [bound]


class PrefillGraphs:
    def __init__(self, executor: Executor, kv_views: dict[str, torch.Tensor], max_tokens: int,
                 max_sequences: int, page_table_width: int) -> None:
        self.executor = executor
        self.kv_views = kv_views
        self.token_buckets = bucket_sizes(min(MIN_TOKEN_BUCKET, max_tokens), max_tokens)
        self.sequence_buckets = bucket_sizes(1, max_sequences)
        self.width = page_table_width
        device = executor.device
        self._capturing = device.type == "cuda"
        size = 3 * max_tokens + 4 * max_sequences + max_sequences * page_table_width
        # Two pinned staging buffers used in turn, as DecodeGraphs does: a step may be staged while
        # the previous step's copy is still in flight.
        self._hosts = [torch.zeros(size, dtype=torch.int32, pin_memory=self._capturing) for _ in range(2)]
        self._turn = 0
        self._device = torch.zeros(size, dtype=torch.int32, device=device)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self._capturing else None

    def fits(self, lists: StepLists) -> bool:
        """A step within the largest buckets, with at most one logits row a sequence."""
        return len(lists.token_ids) <= self.token_buckets[-1] and len(lists.q_len) <= self.sequence_buckets[-1] \
            and len(lists.logits_index) <= len(lists.q_len) and all(len(row) <= self.width for row in lists.page_rows)

    def run(self, lists: StepLists) -> torch.Tensor:
        """Logits ``[len(lists.logits_index), V]`` of the step (a view valid until the next step)."""
        tokens = next(t for t in self.token_buckets if t >= len(lists.token_ids))
        sequences = next(b for b in self.sequence_buckets if b >= len(lists.q_len))
        inputs = self._stage(lists, tokens, sequences)
        n = len(lists.logits_index)
        if not self._capturing:
            return self.executor.run(inputs, self.kv_views)["logits"][:n]
        key = (tokens, sequences)
        if key not in self._graphs:
            self._graphs[key] = self._capture(inputs)
        graph, logits = self._graphs[key]
        graph.replay()
        return logits[:n]

    def _stage(self, lists: StepLists, tokens: int, sequences: int) -> StepInputs:
        """Packs the step into the bucket's layout (token vectors, sequence vectors, page table) at the
        front of the pinned buffer and copies that to the device in one transfer."""
        t, b = len(lists.token_ids), len(lists.q_len)
        token_pad, sequence_pad = [0] * (tokens - t), [0] * (sequences - b)
        flat = [
            *lists.token_ids, *token_pad,
            *lists.positions, *token_pad,
            *lists.slots, *([-1] * (tokens - t)),      # padding tokens store no KV
            *lists.q_start, *([t] * (sequences - b)),
            *lists.q_len, *sequence_pad,               # padding sequences have no tokens
            *lists.kv_len, *sequence_pad,
            *lists.logits_index, *([0] * (sequences - len(lists.logits_index))),
        ]
        table_start = len(flat)
        host = self._hosts[self._turn]
        self._turn ^= 1
        host[:table_start] = as_int_tensor(flat, "i")
        # Only the columns below each sequence's context are read, so only those are written.
        index: list[int] = []
        pages: list[int] = []
        for row, row_pages in enumerate(lists.page_rows):
            start = table_start + row * self.width
            index.extend(range(start, start + len(row_pages)))
            pages.extend(row_pages)
        if index:
            host.index_put_((as_int_tensor(index, "q"),), as_int_tensor(pages, "i"))
        used = table_start + sequences * self.width
        self._device[:used].copy_(host[:used], non_blocking=True)
        return self._inputs(tokens, sequences)

    def _inputs(self, tokens: int, sequences: int) -> StepInputs:
        """The bucket's views of the device buffer: the same addresses on every step, as a graph needs."""
        d = self._device
        token_vectors = [d[i * tokens:(i + 1) * tokens] for i in range(3)]
        base = 3 * tokens
        sequence_vectors = [d[base + i * sequences:base + (i + 1) * sequences] for i in range(4)]
        table_start = base + 4 * sequences
        table = d[table_start:table_start + sequences * self.width].view(sequences, self.width)
        token_ids, positions, slots = token_vectors
        q_start, q_len, kv_len, logits_index = sequence_vectors
        return StepInputs(token_ids=token_ids, positions=positions, slots=slots, q_start=q_start, q_len=q_len,
                          kv_len=kv_len, page_table=table, logits_index=logits_index, max_q_len=tokens,
                          max_kv_len=self.width * self.executor.page_size)

    def _capture(self, inputs: StepInputs) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # The staged step is real: the warm-up runs compute it (storing its K/V), and the replay that
        # follows the capture computes it again, identically.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # Triton compiles and autotunes outside the capture
                self.executor.run(inputs, self.kv_views)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.executor.run(inputs, self.kv_views)["logits"]
        return graph, logits
