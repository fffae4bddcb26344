"""Decode steps as captured CUDA graphs, per batch-size bucket, over static input buffers.

A decode step (every sequence adds ``k`` tokens, ``tokens_per_sequence``: one for plain decoding,
more when a request verifies drafts, and wants the logits of each) of ``n`` sequences runs as a
graph of the smallest bucket ``b >= n``: the step's index lists are written into a pinned host
buffer laid out by the step schema (``step_buffers.StepLayout``, sized for the largest bucket),
copied to the device in one transfer, and sequences ``n..b`` are padding (each field's padding
value: token 0, KV slot -1 so nothing is stored; but each padding sequence has ``k`` tokens and a
context of ``k`` over the reserved page 0). Rows ``k*i .. k*i+k-1`` are sequence ``i``'s tokens and
logits rows, so the layout's ``q_start``, ``q_len`` and ``logits_index`` are the same on every
step: written once. All graphs share the executor's arena, so capturing many buckets costs little
memory. Greedy tokens of every row are computed inside the graph too, so a greedy step (or a greedy
verification) needs no kernel launch after the replay.

Steps take two turns in alternation, each with its own device inputs and its own graph per
bucket, so that nothing is queued on the compute stream between two replays (a copy between
graphs leaves the GPU idle ~5 us, far longer than its bytes take):
- step N+1's inputs go to the device on a copy stream while step N's graph runs (they land in
  the other turn's buffers, which step N does not read);
- with one token a sequence, step N's argmax writes its tokens as step N+1's input ids (so an
  overlapped next step of the same rows, see EngineCore, reads them where they are and its transfer
  skips the ids); with more, into a tokens buffer of the turn (the next step's ids are the accepted
  tokens and new drafts, which the host decides); either way also into pinned host memory
  (``host_mirror``), where the host reads them without a copy.
Events order the rest: a turn's transfer waits for the last replay that read its buffers (and, when
it writes the ids, for the last replay, whose argmax writes them); each replay waits for its
transfer. The host reads step N's tokens before it stages step N+2, which reuses N's pinned buffers.

Only the largest bucket is captured at start-up (its capture sizes the graphs' shared memory pool);
each other bucket is captured the first time a step needs it, after one eager warm-up run of that
step, or earlier while a server has nothing to do (``uncaptured``, ``warm_up_lists``,
``EngineCore.warm_up_idle``), as prefill graphs are. Every bucket's capture costs a warm-up step and
the capture (loading that size's kernels from the artifact's cache first): on an H100, SmolLM2's
nine buckets took 1.5 s of a 5.4 s start, which a server now spends while idle.

Inputs outside the step schema (``extra_inputs``: an EAGLE head's hidden states) get a device buffer
per turn, which ``run`` copies the step's rows into on the compute stream.

On a CPU (no graphs) the same padded path runs eagerly; tests use it to check the padding.
"""

from __future__ import annotations

import time

import torch

from ..sampling import SamplerKernels
from ..scheduler.batch import StepLists
from ..startup import StartupTimer
from .executor import Executor, StepInputs, StepResult
from .expert_load import counted_once
from .graph_capture import WARMUP_RUNS, capture_graph
from .step_buffers import StepLayout

# What the k-tokens-a-sequence layout fixes: rows k*i.. are sequence i's tokens and logits rows.
_LAYOUT_FIELDS = ("q_start", "q_len", "logits_index")


class DecodeGraphs:
    def __init__(self, executor: Executor, kv_views: dict[str, torch.Tensor], buckets: list[int],
                 page_table_width: int, tokens_per_sequence: int = 1, startup: StartupTimer | None = None,
                 extra_inputs: dict[str, tuple[torch.dtype, int]] | None = None) -> None:
        """``startup`` gets the largest bucket's capture's two phases: ``kernel_warmup`` (the run before
        the capture, where Triton compiles or loads its kernels) and ``graph_capture``. ``extra_inputs``: graph
        inputs beyond the step schema's, a row of ``(dtype, width)`` per token (a draft head's hidden
        states), given to ``run`` on the device each step."""
        self.executor = executor
        self.kv_views = kv_views
        self.buckets = sorted(set(buckets))
        self.max_batch = self.buckets[-1]
        self.k = k = tokens_per_sequence
        schema = executor.schema
        too_large = {axis: size for axis, size in self._sizes(self.max_batch).items() if size > executor.bounds[axis]}
        if too_large:
            raise ValueError(f"decode graphs of {self.max_batch} sequences of {k} tokens need {too_large}; the "
                             f"artifact was compiled for at most {executor.bounds}")
        self.layout = StepLayout(schema, self._sizes(self.max_batch), page_table_width)
        self.width = page_table_width
        # A padding sequence has k tokens, so k tokens of context (on page 0, and on whatever stale
        # page a longer context reaches: its slots are -1, so nothing is stored, and its rows are
        # dropped), and a page-table row of page 0.
        self._padding = {"kv_len": k}
        self._padding_row = [0] * -(-k // executor.page_size)
        # Everything but the fixed layout is staged each step; the ids come first in the buffer, so
        # a step whose ids are already on the device copies from the end of their region.
        self._staged = [f.name for f in schema if f.columns is None and f.name not in _LAYOUT_FIELDS]
        assert self._staged[0] == "token_ids" and self.layout.offset["token_ids"] == 0, \
            "the step schema must start with token_ids"
        self._staged_after_ids = self._staged[1:]
        self._after_ids = k * self.max_batch
        device = executor.device
        on_gpu = device.type == "cuda"
        size = self.layout.size
        rows = k * self.max_batch
        # Per turn: the pinned staging buffer, the device inputs, the pinned tokens the argmax leaves,
        # and (k > 1) the device tokens it leaves.
        self._hosts = [torch.zeros(size, dtype=torch.int32, pin_memory=on_gpu) for _ in range(2)]
        self._devices = [torch.zeros(size, dtype=torch.int32, device=device) for _ in range(2)]
        self._mirrors = [torch.zeros(rows, dtype=torch.int32, pin_memory=on_gpu) for _ in range(2)]
        self._tokens = [torch.zeros(rows, dtype=torch.int32, device=device) for _ in range(2)] if k > 1 else None
        self._extras = [{name: torch.zeros(rows, width, dtype=dtype, device=device)
                         for name, (dtype, width) in (extra_inputs or {}).items()} for _ in range(2)]
        fixed = StepLists(q_start=list(range(0, rows, k)), q_len=[k] * self.max_batch, logits_index=list(range(rows)))
        for host in self._hosts:
            self.layout.write_vectors(host, fixed, self._sizes(self.max_batch), list(_LAYOUT_FIELDS))
        # Copies of the table rows each turn's staging buffer holds, so that staging writes only
        # what changed (see StepLayout.write_table).
        self._held_rows: list[list[list[int] | None]] = [[None] * self.max_batch for _ in range(2)]
        self._turn = 0
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._outputs: dict[int, dict[str, torch.Tensor]] = {}
        self._last_tokens: torch.Tensor | None = None  # the last replay's greedy tokens, on the device
        self._capturing = on_gpu
        if on_gpu:
            self._copy_stream = torch.cuda.Stream(device)
            self._warm_up_stream = torch.cuda.Stream(device)
            self._replayed = [torch.cuda.Event() for _ in range(2)]  # each turn's last replay
            self._uploaded = [torch.cuda.Event() for _ in range(2)]  # each turn's last input transfer
            self._pool = torch.cuda.graph_pool_handle()
            self._argmax_rows = SamplerKernels.for_device(device, executor.artifact.kernel_config).argmax_rows
            self._capture_largest(startup or StartupTimer("engine"))

    def fits(self, lists: StepLists) -> bool:
        """A step of k tokens a sequence, with every row's logits, small enough for a bucket."""
        n, k = len(lists.q_len), self.k
        return n <= self.max_batch and len(lists.token_ids) == k * n and len(lists.logits_index) == k * n and \
            min(lists.q_len) == max(lists.q_len) == k and max(map(len, lists.page_table)) <= self.width

    def run(self, lists: StepLists, tokens_from: torch.Tensor | None = None,
            extra_feeds: dict[str, torch.Tensor] | None = None) -> StepResult:
        """The outputs (logits ``[n, V]``, ...) and greedy tokens ``[n]`` of the step's ``n`` rows (views
        valid until the next step). ``tokens_from`` (on the device; one token a sequence only)
        replaces the step's input token ids: an overlapped step reads the previous step's output
        there, without a round trip through the host. ``extra_feeds``: a ``[n, width]`` tensor for
        each of the ``extra_inputs``, on the device."""
        n = len(lists.token_ids)
        bucket = next(b for b in self.buckets if b >= len(lists.q_len))
        turn = self._turn
        self._turn ^= 1
        if tokens_from is not None and self.k > 1:
            raise ValueError("input ids from the device need one token a sequence")
        ids_in_place = tokens_from is not None and self._is_ids_of(turn, tokens_from, n)
        self._stage(lists, bucket, turn, ids_on_device=tokens_from is not None)
        if tokens_from is not None and not ids_in_place:
            self._devices[turn][:n].copy_(tokens_from)
        for name, buffer in self._extras[turn].items():
            # On the compute stream: after the last replay that read this turn's buffer, before this one.
            buffer[:n].copy_(extra_feeds[name])
        if not self._capturing:
            outputs = {name: value[:n] for name, value in self.executor.run(self._inputs(bucket, turn),
                                                                             self.kv_views).items()}
            return StepResult(outputs, outputs["logits"].argmax(dim=-1))
        if bucket not in self._graphs:
            self._capture(bucket, turn)
        torch.cuda.current_stream().wait_event(self._uploaded[turn])
        self._graphs[bucket][turn].replay()
        self._replayed[turn].record()
        self._last_tokens = self._greedy_target(turn)[:n]
        return StepResult({name: value[:n] for name, value in self._outputs[bucket].items()}, self._last_tokens)

    def host_mirror(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """Pinned host memory the last replay's argmax also wrote ``tokens`` to, when ``tokens`` are
        that replay's greedy tokens; complete once the stream has passed the replay."""
        last = self._last_tokens
        if last is None or tokens.data_ptr() != last.data_ptr() or tokens.shape != last.shape:
            return None
        return self._mirrors[self._turn ^ 1][:len(tokens)]

    def uncaptured(self) -> list[int]:
        """The buckets with no graph yet, smallest first (none on a CPU, which captures nothing)."""
        return [b for b in self.buckets if b not in self._graphs] if self._capturing else []

    def warm_up_lists(self, bucket: int) -> StepLists:
        """A step of ``bucket`` sequences of k tokens that stores nothing: every K/V slot is -1 and
        every context is k tokens on page 0, as padding sequences' are. Run, it takes (and at its
        first run captures) the bucket's graph."""
        k, rows = self.k, self.k * bucket
        return StepLists(token_ids=[0] * rows, positions=list(range(k)) * bucket, slots=[-1] * rows,
                         q_start=list(range(0, rows, k)), q_len=[k] * bucket, kv_len=[k] * bucket,
                         page_table=[self._padding_row] * bucket, logits_index=list(range(rows)))

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
        sizes = self._sizes(bucket)
        layout = self.layout
        # Ids already on the device are not staged (PENDING ones come from there).
        names = self._staged_after_ids if ids_on_device else self._staged
        layout.write_vectors(host, lists, sizes, names, self._padding)
        pad = bucket - len(lists.q_len)
        for table in layout.schema.tables():
            rows = (lists.column(table.name) or [[]] * len(lists.q_len)) + [self._padding_row] * pad
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

    def _sizes(self, bucket: int) -> dict[str, int]:
        return {"T": self.k * bucket, "B": bucket, "N": self.k * bucket}

    def _greedy_target(self, turn: int) -> torch.Tensor:
        """Where the argmax of a replay of ``turn`` writes its tokens: the other turn's input ids
        (one token a sequence), else the turn's tokens buffer."""
        return self._devices[turn ^ 1] if self._tokens is None else self._tokens[turn]

    def _inputs(self, bucket: int, turn: int) -> StepInputs:
        views = self.layout.views(self._devices[turn], self._sizes(bucket))
        views.update({name: buffer[:self.k * bucket] for name, buffer in self._extras[turn].items()})
        # max_kv_len stays at the table's reach: the graph must serve any context up to it.
        return StepInputs(views, max_q_len=self.k, max_kv_len=self.width * self.executor.page_size)

    def _capture_largest(self, startup: StartupTimer) -> None:
        """The largest bucket's graphs, on padding rows, timed as start-up's ``kernel_warmup`` (the
        eager run where Triton compiles or loads its kernels) and ``graph_capture``."""
        began = time.time()
        self._stage(StepLists.empty(self.executor.schema), self.max_batch, 0)
        warmup = self._capture(self.max_batch, 0)
        torch.cuda.synchronize()
        startup.add("kernel_warmup", began, warmup)
        startup.add("graph_capture", began + warmup, time.time() - began - warmup)

    def _capture(self, bucket: int, turn: int) -> float:
        """Captures ``bucket``'s graph for both turns after one eager warm-up run of the inputs staged
        in ``turn`` (the other turn runs the same kernels at the same sizes on other buffers); the
        warm-up's seconds. The staged step may be real (a bucket's first step): the warm-up computes it,
        storing its K/V and writing its tokens, and the replay that follows computes the same again;
        its expert counters are put back (``counted_once``), so the step counts once."""
        rows = self.k * bucket
        current = torch.cuda.current_stream()
        current.wait_event(self._uploaded[turn])
        self._warm_up_stream.wait_stream(current)
        began = time.time()
        # Warm-up: Triton compiles and autotunes outside the capture, and the argmax's first launch
        # sizes the semaphore counters, which must not be allocated inside it.
        with torch.cuda.stream(self._warm_up_stream), counted_once(self.kv_views):
            for _ in range(WARMUP_RUNS):
                logits = self.executor.run(self._inputs(bucket, turn), self.kv_views)["logits"]
                self._argmax_rows(logits, self._greedy_target(turn)[:rows], mirror=self._mirrors[turn][:rows])
        current.wait_stream(self._warm_up_stream)
        current.synchronize()
        warmup = time.time() - began
        graphs = []
        for each in range(2):
            graph = torch.cuda.CUDAGraph()
            with capture_graph(graph, self._pool):
                outputs = self.executor.run(self._inputs(bucket, each), self.kv_views)
                # torch's argmax reduces each row in one thread block (~28 us for a 128k vocabulary on
                # an H200); the Triton kernel spreads every row over the SMs. The tokens (the other
                # turn's input ids, with one token a sequence) reach the host in the mirror.
                self._argmax_rows(outputs["logits"], self._greedy_target(each)[:rows],
                                  mirror=self._mirrors[each][:rows])
            graphs.append(graph)
            # Both turns' outputs are views of the one arena, so either turn's views serve.
            kept = self._outputs.setdefault(bucket, outputs)
            assert all(kept[name].data_ptr() == value.data_ptr() for name, value in outputs.items())
        self._graphs[bucket] = graphs
        return warmup
