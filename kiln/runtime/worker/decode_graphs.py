"""Decode steps as captured CUDA graphs, per batch-size bucket, over static input buffers.

A decode step (every sequence adds one token) of ``n`` sequences runs as a graph of the smallest
bucket ``b >= n``: the step's index lists are written into a pinned host buffer, copied to the
device in one transfer, and rows ``n..b`` are padding (token 0, KV slot -1 so nothing is stored,
context 1 over the reserved page 0). All graphs share the executor's arena, so capturing many
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

from array import array

import torch

from ..sampling import SamplerKernels
from ..scheduler.batch import StepLists
from .executor import Executor, StepInputs

# Per-sequence int32 vectors of a decode step, in their order in the static buffer: first those staged
# every step, then those every decode step fills alike (row i is token i, one long, and its logits
# are wanted), written once for all buckets.
_VECTORS = ("token_ids", "positions", "slots", "kv_len", "q_start", "q_len", "logits_index")
_STAGED_VECTORS = 4


class DecodeGraphs:
    def __init__(self, executor: Executor, kv_views: dict[str, torch.Tensor], buckets: list[int],
                 page_table_width: int) -> None:
        self.executor = executor
        self.kv_views = kv_views
        self.buckets = sorted(set(buckets))
        self.width = page_table_width
        self.max_batch = self.buckets[-1]
        device = executor.device
        on_gpu = device.type == "cuda"
        self._vector_len = len(_VECTORS) * self.max_batch
        size = self._vector_len + self.max_batch * self.width
        # Per turn: the pinned staging buffer, the device inputs, the pinned tokens the argmax leaves.
        self._hosts = [torch.zeros(size, dtype=torch.int32, pin_memory=on_gpu) for _ in range(2)]
        self._devices = [torch.zeros(size, dtype=torch.int32, device=device) for _ in range(2)]
        self._mirrors = [torch.zeros(self.max_batch, dtype=torch.int32, pin_memory=on_gpu) for _ in range(2)]
        rows = list(range(self.max_batch))
        fixed = as_int_tensor(rows + [1] * self.max_batch + rows, "i")    # q_start, q_len, logits_index
        for host in self._hosts:
            host[_STAGED_VECTORS * self.max_batch:self._vector_len] = fixed
        # Copies of the page-table rows each turn's staging buffer holds, so that staging writes only
        # what changed: rewriting every page of every row took ~2 ms a step at batch 256 with
        # 1024-token contexts. (Copies, compared by content: a request's pages may change in place.)
        self._staged_rows: list[list[list[int] | None]] = [[None] * self.max_batch for _ in range(2)]
        self._turn = 0
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._logits: dict[int, torch.Tensor] = {}
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
            max(map(len, lists.page_rows)) <= self.width

    def run(self, lists: StepLists, tokens_from: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[n, V]`` and greedy tokens ``[n]`` of a decode step (views valid until the next step).
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
            logits = self.executor.run(self._inputs(bucket, turn), self.kv_views)["logits"]
            return logits[:n], logits[:n].argmax(dim=-1)
        torch.cuda.current_stream().wait_event(self._uploaded[turn])
        self._graphs[bucket][turn].replay()
        self._replayed[turn].record()
        self._last_tokens = self._devices[turn ^ 1][:n]
        return self._logits[bucket][:n], self._last_tokens

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
        ``ids_on_device``), on the copy stream on a GPU. Built as two flat Python lists and two tensor
        writes: this runs on every decode step, and per-row tensor writes cost ~5 us each. (Lists
        become tensors through ``array``: 3x faster than ``torch.tensor`` on a list, yet still the
        largest cost here, so only the vectors that change are converted.)"""
        n = len(lists.token_ids)
        host = self._hosts[turn]
        staged = self._staged_rows[turn]
        pad = bucket - n
        gap = [0] * (self.max_batch - bucket)       # the rest of each vector's space, unread
        # Ids already on the device are not staged (PENDING ones come from there).
        flat = [] if ids_on_device else [max(t, 0) for t in lists.token_ids] + [0] * pad + gap
        flat += lists.positions + [0] * pad + gap
        flat += lists.slots + [-1] * pad + gap      # padding rows store no KV
        flat += lists.kv_len + [1] * pad            # one token of context, on the reserved page 0
        # The ids come first in the buffer; a device-side copy may fill them in afterwards.
        first = self.max_batch if ids_on_device else 0
        host[first:first + len(flat)] = as_int_tensor(flat, "i")
        # Page-table rows: only the columns below each row's context are read, so only those are
        # written, and only where the buffer does not hold them already (a decoding row gains a
        # page every page_size steps: only its new tail is written); padding rows read column 0,
        # which must name page 0.
        index: list[int] = []
        pages: list[int] = []
        rows = lists.page_rows + [[0]] * pad
        for row in [row for row, (held, row_pages) in enumerate(zip(staged, rows)) if held != row_pages]:
            held, row_pages = staged[row], rows[row]
            start = self._vector_len + row * self.width
            keep = len(held) if held is not None and len(held) < len(row_pages) and row_pages[:len(held)] == held else 0
            index.extend(range(start + keep, start + len(row_pages)))
            pages.extend(row_pages[keep:])
            staged[row] = list(row_pages)
        if index:
            host.index_put_((as_int_tensor(index, "q"),), as_int_tensor(pages, "i"))
        used = self._vector_len + bucket * self.width
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
        device = self._devices[turn]
        views = {name: device[i * self.max_batch:i * self.max_batch + bucket] for i, name in enumerate(_VECTORS)}
        table = device[self._vector_len:self._vector_len + bucket * self.width].view(bucket, self.width)
        # max_kv_len stays at the table's reach: the graph must serve any context up to it.
        return StepInputs(page_table=table, max_q_len=1, max_kv_len=self.width * self.executor.page_size, **views)

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.executor.device)
        empty = StepLists([], [], [], [], [], [], [], [], [])
        argmax_rows = SamplerKernels.for_device(self.executor.device, self.executor.artifact.kernel_config).argmax_rows
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
                        argmax_rows(self.executor.run(inputs, self.kv_views)["logits"], ids, mirror=mirror)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self.executor.run(inputs, self.kv_views)["logits"]
                    # torch's argmax reduces each row in one thread block (~28 us for a 128k
                    # vocabulary on an H200); the Triton kernel spreads every row over the SMs.
                    argmax_rows(logits, ids, mirror=mirror)
                graphs.append(graph)
                # Both turns' logits are the arena's one logits buffer, so either turn's view serves.
                assert self._logits.setdefault(bucket, logits).data_ptr() == logits.data_ptr()
            self._graphs[bucket] = graphs
        torch.cuda.synchronize()


_DTYPES = {"i": torch.int32, "q": torch.int64}


def as_int_tensor(values: list[int], typecode: str) -> torch.Tensor:
    """A non-empty list of ints as an int32 ("i") or int64 ("q") tensor viewing an ``array``'s buffer."""
    return torch.frombuffer(array(typecode, values), dtype=_DTYPES[typecode])
