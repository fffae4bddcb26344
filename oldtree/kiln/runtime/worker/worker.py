"""The worker interface: what the engine core drives a model through, one rank or several.

A worker takes a step's lists and returns rank 0's ``StepResult`` (the step's outputs by name:
logits rows, hidden states where the schema declares them; greedy tokens for decode graph steps),
samples over the logits rows, and says what the core must know about it: the KV pool's
size and the device its tokens live on. Two implementations:

- ``LocalWorker``: one rank, the model runner in the core's process. Its methods are the runner's
  own, bound once, so the core calls the runner exactly as directly as without this interface.
- ``ranks.WorkerGroup``: rank 0 in the core's process, ranks 1..N-1 in worker processes that get
  every step by broadcast before rank 0 runs it (for a pipelined artifact each rank's runner is a
  ``PipelineRunner`` of its stage).

``ranks.start_worker`` picks one from ``RankConfig.world_size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..artifact import Artifact, load_artifact
from ..sampling import SamplerOutput, SamplingBatch
from ..scheduler.batch import StepLists
from ..startup import StartupTimer
from .executor import StepResult
from .model_runner import ModelRunner
from .pipeline_runner import PipelineRunner
from .rank_grid import RankGrid


class WorkerDied(RuntimeError):
    """A worker process ended while the engine needed it; the message names the rank and how it ended."""


class Worker(Protocol):
    runner: ModelRunner           # rank 0's, in this process (tests and benchmarks look inside it)
    device: torch.device          # where forward's outputs and sample's inputs live
    num_pages: int                # pages of every rank's KV pool (page 0 reserved), the allocator's size
    tokens_from_device: bool      # whether forward takes tokens_from (overlapped decode)

    def forward(self, lists: StepLists, tokens_from: torch.Tensor | None = None) -> StepResult:
        """Runs the step on every rank; rank 0's outputs (see ModelRunner.forward)."""

    def sample(self, logits: torch.Tensor, batch: SamplingBatch, allowed: torch.Tensor | None = None
               ) -> SamplerOutput:
        """Draws each row's token from rank 0's logits."""

    def host_mirror(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """Host memory the step that made ``tokens`` also wrote them to, if any."""

    def check(self) -> None:
        """Raises ``WorkerDied`` if a rank has ended; cheap enough for an idle loop."""

    def close(self) -> None:
        """Stops the ranks; idempotent."""


@dataclass(frozen=True)
class RankConfig:
    """What every rank needs to build its model runner: plain values, which the worker processes
    receive once, when they start."""

    artifact_path: str
    device: str                       # rank 0's; rank i runs on the i-th device after it (rank_device)
    num_pages: int
    decode_buckets: tuple[int, ...]
    prefill_graphs: bool
    world_size: int = 1
    # Whether the artifact is tensor- or expert-parallel or pipelined (each rank loads its own weights
    # file and runs the collectives in its program) rather than replicated (every rank loads rank 0's).
    tensor_parallel: bool = False
    reference_fallback: bool = False  # run torch references where the GPU cannot run the artifact's FP8
    # Tokens a sequence brings to a speculative verify step (drafts + 1; 1: no speculation): with
    # decode buckets, uniform verify steps run as decode graphs of that many tokens a sequence.
    verify_tokens: int = 1
    # Pipeline stages (a pipelined artifact's runtime.pp; world_size // pp ranks each, rank_grid.py),
    # and the micro-batches a step is split into so that they overlap (pipeline_runner.py).
    pp: int = 1
    micro_batches: int = 2
    # Machines the ranks are spread over (``nodes.py``): node n runs ranks n*k..(n+1)*k-1 (k =
    # world_size / nnodes), a contiguous range of the grid's ranks (so the tp/pp groups are the same
    # on one node or several), and every rank meets the others at ``dist_init_addr`` (HOST:PORT, node
    # 0's rendezvous store). One node: the group's store is on loopback, on a free port.
    nnodes: int = 1
    dist_init_addr: str | None = None

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def node_ranks(self, node: int) -> range:
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def rank_device(self, rank: int) -> torch.device:
        device = torch.device(self.device)
        if device.type != "cuda":
            return device  # CPU ranks share the host
        return torch.device("cuda", (device.index or 0) + rank % self.ranks_per_node)

    @property
    def grid(self) -> RankGrid:
        return RankGrid(self.world_size // self.pp, self.pp)

    def build_runner(self, artifact: Artifact, rank: int, startup: StartupTimer | None = None) -> ModelRunner:
        """Rank ``rank``'s runner; ``startup`` times its loading phases (a one-stage artifact's)."""
        if self.pp > 1:  # the stage's own program, weights and layers' KV pool
            stage = load_artifact(artifact.path, self.grid.stage(rank))
            return PipelineRunner(stage, self.rank_device(rank), self.num_pages, rank, self.grid, self.micro_batches,
                                  self.reference_fallback)
        return ModelRunner(artifact, self.rank_device(rank), self.num_pages, self.decode_buckets, self.prefill_graphs,
                           rank if self.tensor_parallel else 0, self.reference_fallback, self.verify_tokens, startup)


class LocalWorker:
    """One rank, in this process: the model runner's methods themselves."""

    tokens_from_device = True

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.device = runner.device
        self.num_pages = runner.pool.num_pages
        # Bound once: the core's call is then the runner's call, with no wrapper between.
        self.forward = runner.forward
        self.sample = runner.sample
        self.host_mirror = runner.host_mirror

    def check(self) -> None:
        pass  # nothing outside this process to lose

    def close(self) -> None:
        pass  # the runner's memory goes with the last reference to it
