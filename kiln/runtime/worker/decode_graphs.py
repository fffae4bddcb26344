"""Decode steps as captured CUDA graphs, per batch-size bucket, over static input buffers.

A decode step (every sequence adds one token) of ``n`` sequences runs as a graph of the smallest
bucket ``b >= n``: the step's index lists are written into a pinned host buffer laid out by the
step schema (``step_buffers.StepLayout``, every axis' capacity the largest bucket), copied to the
device in one transfer, and rows ``n..b`` are padding (each field's padding value: token 0, KV slot
-1 so nothing is stored; but each padding row is a sequence of one token, with a context of 1 over
the reserved page 0). Row ``i`` is sequence ``i``'s one token and its logits row, so the layout's
``q_start``, ``q_len`` and ``logits_index`` are the same on every step: written once. All graphs share the executor's arena, so capturing many
buckets costs little memory. Greedy tokens are computed inside the graph too, so a greedy step
needs no kernel launch after the replay.

Steps take two turns in alternation, each with its own device inputs and its own graph per
bucket, so that nothing is queued on the compute stream between two replays (a copy between
graphs leaves the GPU idle ~5 us, far longer than its bytes take):
- step N+1's inputs go to the device on a copy stream while step N's graph runs (they land in
  the other turn's buffers, which step N does not read);
- step N's argmax writes its tokens as step N+1's input ids (so an overlapped next step of the
  same rows, see EngineCore, reads them where they are and its transfer skips the ids), and into
  pinned host memory (``host_mirror``), where the host reads them without a copy.
Events order the rest: a turn's transfer waits for the last replay that read its buffers (and, when
it writes the ids, for the last replay, whose argmax writes them); each replay waits for its
transfer. The host reads step N's tokens before it stages step N+2, which reuses N's pinned buffers.

On a CPU (no graphs) the same padded path runs eagerly; tests use it to check the padding.
"""

from __future__ import annotations

import torch

from kiln.kernels.argmax import triton_argmax_rows

from ..scheduler.batch import StepLists
from .executor import Executor, StepInputs, StepResult
from .step_buffers import StepLayout

# What the one-token-a-sequence layout fixes: row i is sequence i's only token and its logits row.
_LAYOUT_FIELDS = ("q_start", "q_len", "logits_index")
# A padding row is a sequence of one token, so it has one token of context (page 0's first slot).
_DECODE_PADDING = {"kv_len": 1}


class DecodeGraphs:
    def __init__(self, executor: Executor, kv_views: dict[str, torch.Tensor], buckets: list[int],
                 page_table_width: int) -> None:
        self.executor = executor
        self.kv_views = kv_views
        self.buckets = sorted(set(buckets))
        self.max_batch = self.buckets[-1]
        schema = executor.schema
        self.layout = StepLayout(schema, {"T": self.max_batch, "B": self.max_batch, "N": self.max_batch},
                                 page_table_width)
        self.width = page_table_width
        # Everything but the fixed layout is staged each step; the ids come first in the buffer, so
        # a step whose ids are already on the device copies from the end of their region.
        self._staged = [f.name for f in schema if f.columns is None and f.name not in _LAYOUT_FIELDS]
        assert self._staged[0] == "token_ids" and self.layout.offset["token_ids"] == 0, \
            "the step schema must start with token_ids"
        self._staged_after_ids = self._staged[1:]
        self._after_ids = self.max_batch
        device = executor.device
        on_gpu = device.type == "cuda"
        size = self.layout.size
        # Per turn: the pinned staging buffer, the device inputs, the pinned tokens the argmax leaves.
        self._hosts = [torch.zeros(size, dtype=torch.int32, pin_memory=on_gpu) for _ in range(2)]
        self._devices = [torch.zeros(size, dtype=torch.int32, device=device) for _ in range(2)]
        self._mirrors = [torch.zeros(self.max_batch, dtype=torch.int32, pin_memory=on_gpu) for _ in range(2)]
        rows = list(range(self.max_batch))
        fixed = StepLists(q_start=rows, q_len=[1] * self.max_batch, logits_index=rows)
        full = {"T": self.max_batch, "B": self.max_batch, "N": self.max_batch}
        for host in self._hosts:
            self.layout.write_vectors(host, fixed, full, list(_LAYOUT_FIELDS))
        # Copies of the table rows each turn's staging buffer holds, so that staging writes only
        # what changed (see StepLayout.write_table).
        self._held_rows: list[list[list[int] | None]] = [[None] * self.max_batch for _ in range(2)]
        self._turn = 0
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._outputs: dict[int, dict[str, torch.Tensor]] = {}
        self._last_tokens: torch.Tensor | None = None  # the last replay's greedy tokens, on the device
        if on_gpu:
            self._copy_stream = torch.cuda.Stream(device)
            self._replayed = [torch.cuda.Event() for _ in range(2)]  # each turn's last replay
            self._uploaded = [torch.cuda.Event() for _ in range(2)]  # each turn's last input transfer
            self._capture()

    def fits(self, lists: StepLists) -> bool:
        """A decode-only step small enough for a bucket."""
        n = len(lists.token_ids)
        return n <= self.max_batch and len(lists.logits_index) == n and max(lists.q_len) == 1 and \
            max(map(len, lists.page_table)) <= self.width

    def run(self, lists: StepLists, tokens_from: torch.Tensor | None = None) -> StepResult:
        """The outputs (logits ``[n, V]``, ...) and greedy tokens ``[n]`` of a decode step (views valid
        until the next step).
        ``tokens_from`` (on the device) replaces the step's input token ids: an overlapped step reads
        the previous step's output there, without a round trip through the host."""
        n = len(lists.token_ids)
        bucket = next(b for b in self.buckets if b >= n)
        turn = self._turn
        self._turn ^= 1
        ids_in_place = tokens_from is not None and self._is_ids_of(turn, tokens_from, n)
        self._stage(lists, bucket, turn, ids_on_device=tokens_from is not None)
        if tokens_from is not None and not ids_in_place:
            self._devices[turn][:n].copy_(tokens_from)
        if bucket not in self._graphs:
            outputs = {name: value[:n] for name, value in self.executor.run(self._inputs(bucket, turn),
                                                                             self.kv_views).items()}
            return StepResult(outputs, outputs["logits"].argmax(dim=-1))
        torch.cuda.current_stream().wait_event(self._uploaded[turn])
        self._graphs[bucket][turn].replay()
        self._replayed[turn].record()
        self._last_tokens = self._devices[turn ^ 1][:n]
        return StepResult({name: value[:n] for name, value in self._outputs[bucket].items()}, self._last_tokens)

    def host_mirror(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """Pinned host memory the last replay's argmax also wrote ``tokens`` to, when ``tokens`` are
        that replay's greedy tokens; complete once the stream has passed the replay."""
        last = self._last_tokens
        if last is None or tokens.data_ptr() != last.data_ptr() or tokens.shape != last.shape:
            return None
        return self._mirrors[self._turn ^ 1][:len(tokens)]

    def graph(self, bucket: int) -> torch.cuda.CUDAGraph:
        """A bucket's captured step (its first turn's), for benchmarks that replay it alone."""
        return self._graphs[bucket][0]

    def _is_ids_of(self, turn: int, tokens: torch.Tensor, n: int) -> bool:
        """Whether ``tokens`` are the first ``n`` input ids of ``turn`` themselves, as the previous
        graph's argmax left them."""
        ids = self._devices[turn]
        return tokens.dtype == ids.dtype and tokens.data_ptr() == ids.data_ptr() and tokens.shape == (n,)

    def _stage(self, lists: StepLists, bucket: int, turn: int, ids_on_device: bool = False) -> None:
        """Writes the step's inputs into the turn's pinned host buffer, then copies what the bucket
        reads to the turn's device buffer in one transfer (all but the input ids when
        ``ids_on_device``), on the copy stream on a GPU. This runs on every decode step: only the
        fields that change are written, and table rows only where they changed."""
        host = self._hosts[turn]
        sizes = {"T": bucket, "B": bucket, "N": bucket}
        layout = self.layout
        # Ids already on the device are not staged (PENDING ones come from there).
        names = self._staged_after_ids if ids_on_device else self._staged
        layout.write_vectors(host, lists, sizes, names, _DECODE_PADDING)
        pad = bucket - len(lists.token_ids)
        for table in layout.schema.tables():
            # Padding rows read column 0, which must name page 0.
            rows = (lists.column(table.name) or [[]] * len(lists.token_ids)) + [[0]] * pad
            layout.write_table(host, table, rows, self._held_rows[turn])
        first = self._after_ids if ids_on_device else 0
        used = layout.end(sizes)
        device = self._devices[turn]
        if device.device.type != "cuda":
            device[first:used].copy_(host[first:used])
            return
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(self._replayed[turn])  # the last replay that read these buffers
            if not ids_on_device:
                self._copy_stream.wait_event(self._replayed[turn ^ 1])  # its argmax writes these ids
            device[first:used].copy_(host[first:used], non_blocking=True)
            self._uploaded[turn].record(self._copy_stream)

    def _inputs(self, bucket: int, turn: int) -> StepInputs:
        views = self.layout.views(self._devices[turn], {"T": bucket, "B": bucket, "N": bucket})
        # max_kv_len stays at the table's reach: the graph must serve any context up to it.
        return StepInputs(views, max_q_len=1, max_kv_len=self.width * self.executor.page_size)

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.executor.device)
        empty = StepLists.empty(self.executor.schema)
        for bucket in reversed(self.buckets):
            graphs = []
            for turn in range(2):
                self._stage(empty, bucket, turn)
                torch.cuda.current_stream().wait_event(self._uploaded[turn])
                inputs = self._inputs(bucket, turn)
                # The tokens become the other turn's input ids, and reach the host in the mirror.
                ids, mirror = self._devices[turn ^ 1][:bucket], self._mirrors[turn][:bucket]
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    # Warm-up: Triton compiles and autotunes outside the capture, and the argmax's
                    # first launch sizes the semaphore counters, which must not be allocated inside it.
                    for _ in range(2):
                        triton_argmax_rows(self.executor.run(inputs, self.kv_views)["logits"], ids, mirror=mirror)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    outputs = self.executor.run(inputs, self.kv_views)
                    # torch's argmax reduces each row in one thread block (~28 us for a 128k
                    # vocabulary on an H200); the Triton kernel spreads every row over the SMs.
                    triton_argmax_rows(outputs["logits"], ids, mirror=mirror)
                graphs.append(graph)
                # Both turns' outputs are views of the one arena, so either turn's views serve.
                kept = self._outputs.setdefault(bucket, outputs)
                assert all(kept[name].data_ptr() == value.data_ptr() for name, value in outputs.items())
            self._graphs[bucket] = graphs
        torch.cuda.synchronize()
