"""A pipeline stage's model runner: one rank of one stage of a pipelined artifact (``runtime.pp`` > 1).

Every rank gets the whole step (rank 0 broadcasts its lists, as for any group) and splits it the
same way into micro-batches (``micro_batches.split_step``: the step's sequences in consecutive
groups of about equal tokens), then runs its stage's program on each in turn. A stage's program
begins by receiving the micro-batch's hidden state from the stage before and ends by sending its
own to the next (``passes/split_pipeline.py``), so while stage 1 runs micro-batch 0, stage 0 runs
micro-batch 1: with two micro-batches in flight the stages overlap.

The last stage sends each micro-batch's logits to stage 0 as soon as its program made them (every
rank to the rank of its own tensor-parallel rank, through the ``logits`` group, ``rank_grid.py``).
Stage 0 posts a receive for every micro-batch's logits before it runs the first one (so no stage
ever waits on a send that stage 0 has not yet asked for), and after its last micro-batch puts them
back in the step's row order:
rank 0 then samples from them as from a one-stage step, so every sampling feature (grammar masks,
penalties, logprobs) works unchanged. Other ranks return no outputs; only rank 0's are read.

Steps run op by op (``forward_eager``); decode and prefill CUDA graphs are not captured for stages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kiln.kernels.collective import named_group

from ..artifact import Artifact
from ..scheduler.batch import StepLists
from .executor import StepResult
from .micro_batches import split_step
from .model_runner import ModelRunner
from .rank_grid import RankGrid


class PipelineRunner(ModelRunner):
    def __init__(self, stage_artifact: Artifact, device: torch.device | str, num_pages: int, rank: int,
                 grid: RankGrid, micro_batches: int, reference_fallback: bool = False) -> None:
        super().__init__(stage_artifact, device, num_pages, rank=rank, reference_fallback=reference_fallback)
        self.stage = grid.stage(rank)
        self.last_stage = grid.pp - 1
        self.micro_batches = micro_batches

    def forward(self, lists: StepLists, tokens_from: torch.Tensor | None = None) -> StepResult:
        if tokens_from is not None:
            raise ValueError("tokens_from: a pipeline stage's input ids come from the host")
        parts = split_step(lists, self.executor.schema, self.micro_batches)
        logits_group = named_group("logits")
        if self.stage != 0:
            stage_0 = dist.get_global_rank(logits_group, 0)
            for part in parts:
                outputs = self.forward_eager(part.lists).outputs
                if self.stage == self.last_stage:
                    dist.send(outputs["logits"].contiguous(), stage_0, group=logits_group)
            return StepResult({}, None)
        last = dist.get_global_rank(logits_group, self.last_stage)
        received = [torch.empty((len(part.rows), self.vocab_size), dtype=torch.float32, device=self.device)
                    for part in parts]
        pending = [dist.irecv(logits, last, group=logits_group) for logits in received]
        for part in parts:
            self.forward_eager(part.lists)
        for request in pending:
            request.wait()
        logits = torch.empty((len(lists.logits_index), self.vocab_size), dtype=torch.float32, device=self.device)
        for part, part_logits in zip(parts, received):
            logits[part.rows] = part_logits
        return StepResult({"logits": logits}, None)
