"""Decode steps as captured CUDA graphs, one per batch-size bucket, over static input buffers.

A decode step (every sequence adds one token) of ``n`` sequences runs as the graph of the smallest
bucket ``b >= n``: the step's index lists are written into a pinned host buffer, copied to the
device in one transfer, and rows ``n..b`` are padding (token 0, KV slot -1 so nothing is stored,
context 1 over the reserved page 0). All graphs share the executor's arena and the static inputs,
so capturing many buckets costs little memory. Greedy tokens are computed inside the graph too, so
a greedy step needs no kernel launch after the replay. An overlapped step (see EngineCore) takes
its input ids from the previous step's device output instead of the host. The graph's argmax
writes its tokens straight into the static input ids, so when the next step is the same rows that
output is already its input: its transfer skips the ids, and nothing runs between the two replays
but that transfer and the tokens' copy to the host.

On a CPU (no graphs) the same padded path runs eagerly; tests use it to check the padding.
"""

from __future__ import annotations

from array import array

import torch

from kiln.kernels.argmax import triton_argmax_rows

from .executor import Executor, StepInputs
from .scheduler.batch import StepLists

# Per-sequence int32 vectors of a decode step, in their order in the static buffer.
_VECTORS = ("token_ids", "positions", "slots", "q_start", "q_len", "kv_len", "logits_index")


class DecodeGraphs:
    def __init__(self, executor: Executor, kv_views: dict[str, torch.Tensor], buckets: list[int],
                 page_table_width: int) -> None:
        self.executor = executor
        self.kv_views = kv_views
        self.buckets = sorted(set(buckets))
        self.width = page_table_width
        self.max_batch = self.buckets[-1]
        device = executor.device
        self._vector_len = len(_VECTORS) * self.max_batch
        size = self._vector_len + self.max_batch * self.width
        # Two pinned staging buffers, used in turn: with overlapped steps the host stages step N+1
        # before step N's copy is guaranteed done, but step N-1's tokens (read by then) were made
        # after N-1's copy, so the buffer N-1 used is free again.
        self._hosts = [torch.zeros(size, dtype=torch.int32, pin_memory=device.type == "cuda") for _ in range(2)]
        self._turn = 0
        self._device = torch.zeros(size, dtype=torch.int32, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self._greedy: dict[int, torch.Tensor] = {}
        if device.type == "cuda":
            self._capture()

    def fits(self, lists: StepLists) -> bool:
        """A decode-only step small enough for a bucket."""
        n = len(lists.token_ids)
        return n <= self.max_batch and len(lists.logits_index) == n and max(lists.q_len) == 1 and \
            all(len(row) <= self.width for row in lists.page_rows)

    def run(self, lists: StepLists, tokens_from: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[n, V]`` and greedy tokens ``[n]`` of a decode step (views valid until the next step).
        ``tokens_from`` (on the device) replaces the step's input token ids: an overlapped step reads
        the previous step's output there, without a round trip through the host."""
        n = len(lists.token_ids)
        bucket = next(b for b in self.buckets if b >= n)
        self._stage(lists, bucket, ids_on_device=tokens_from is not None)
        if tokens_from is not None and not self._is_greedy_output(tokens_from, n):
            self._device[:n].copy_(tokens_from)
        if bucket in self._graphs:
            self._graphs[bucket].replay()
            return self._logits[bucket][:n], self._greedy[bucket][:n]
        logits = self.executor.run(self._inputs(bucket), self.kv_views)["logits"]
        return logits[:n], logits[:n].argmax(dim=-1)

    def graph(self, bucket: int) -> torch.cuda.CUDAGraph:
        """A bucket's captured step, for benchmarks that replay it alone."""
        return self._graphs[bucket]

    def _is_greedy_output(self, tokens: torch.Tensor, n: int) -> bool:
        """Whether ``tokens`` are the first ``n`` input ids themselves, as a graph's argmax left them."""
        return tokens.dtype == self._device.dtype and tokens.data_ptr() == self._device.data_ptr() \
            and tokens.shape == (n,)

    def _stage(self, lists: StepLists, bucket: int, ids_on_device: bool = False) -> None:
        """Writes the step's inputs into the pinned host buffer, then copies what the bucket reads to
        the device in one transfer (all but the input ids when ``ids_on_device``). Built as two flat
        Python lists and two tensor writes: this runs on every decode step, and per-row tensor writes
        cost ~5 us each. (Lists become tensors through ``array``: 3x faster than ``torch.tensor`` on a
        list.)"""
        n = len(lists.token_ids)
        host = self._hosts[self._turn]
        self._turn ^= 1
        pad = range(n, bucket)
        vectors = (
            [max(t, 0) for t in lists.token_ids] + [0] * len(pad),  # PENDING ids come from the device
            lists.positions + [0] * len(pad),
            lists.slots + [-1] * len(pad),          # padding rows store no KV
            lists.q_start + list(pad),
            lists.q_len + [1] * len(pad),
            lists.kv_len + [1] * len(pad),          # one token of context, on the reserved page 0
            lists.logits_index + list(pad),
        )
        flat: list[int] = []
        for values in vectors:
            flat.extend(values)
            flat.extend([0] * (self.max_batch - bucket))
        host[:self._vector_len] = as_int_tensor(flat, "i")
        # Page-table rows: only the columns below each row's context are read, so only those are
        # written; padding rows read column 0, which must name page 0.
        index: list[int] = []
        pages: list[int] = []
        for row, row_pages in enumerate(lists.page_rows):
            start = self._vector_len + row * self.width
            index.extend(range(start, start + len(row_pages)))
            pages.extend(row_pages)
        index.extend(self._vector_len + row * self.width for row in pad)
        pages.extend(0 for _ in pad)
        if index:
            host.index_put_((as_int_tensor(index, "q"),), as_int_tensor(pages, "i"))
        used = self._vector_len + bucket * self.width
        # The ids come first in the buffer; a device-side copy may fill them in afterwards.
        first = self.max_batch if ids_on_device else 0
        self._device[first:used].copy_(host[first:used], non_blocking=True)

    def _inputs(self, bucket: int) -> StepInputs:
        views = {name: self._device[i * self.max_batch:i * self.max_batch + bucket] for i, name in enumerate(_VECTORS)}
        table = self._device[self._vector_len:self._vector_len + bucket * self.width].view(bucket, self.width)
        # max_kv_len stays at the table's reach: the graph must serve any context up to it.
        return StepInputs(page_table=table, max_q_len=1, max_kv_len=self.width * self.executor.page_size, **views)

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for bucket in reversed(self.buckets):
            inputs = self._stage_padding_only(bucket)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                # Warm-up: Triton compiles and autotunes outside the capture, and the argmax's first
                # launch sizes the semaphore counters, which must not be allocated inside it.
                for _ in range(2):
                    triton_argmax_rows(self.executor.run(inputs, self.kv_views)["logits"], out=inputs.token_ids)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.executor.run(inputs, self.kv_views)["logits"]
                # torch's argmax reduces each row in one thread block (~28 µs for a 128k vocabulary
                # on an H200); the Triton kernel spreads every row over the SMs. Its output is the
                # input ids, so that an overlapped next step of the same rows needs no copy.
                greedy = triton_argmax_rows(logits, out=inputs.token_ids)
            self._graphs[bucket] = graph
            self._logits[bucket] = logits
            self._greedy[bucket] = greedy
        torch.cuda.synchronize()

    def _stage_padding_only(self, bucket: int) -> StepInputs:
        empty = StepLists([], [], [], [], [], [], [], [], [])
        self._stage(empty, bucket)
        return self._inputs(bucket)


_DTYPES = {"i": torch.int32, "q": torch.int64}


def as_int_tensor(values: list[int], typecode: str) -> torch.Tensor:
    """A non-empty list of ints as an int32 ("i") or int64 ("q") tensor viewing an ``array``'s buffer."""
    return torch.frombuffer(array(typecode, values), dtype=_DTYPES[typecode])
