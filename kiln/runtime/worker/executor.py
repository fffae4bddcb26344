"""The executor: runs an artifact's step program over static buffers.

It owns the arena the compiler planned (one byte buffer; every intermediate value is a view at a
fixed offset), its rank's weights on the device, and the kernel table the program is bound to. Step
outputs are views into the arena: read or copy them before the next step overwrites them.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from kiln.artifact_format import GENERATED_KERNEL_PREFIX, generated_kernel_file
from kiln.kernels import KernelImpl, get_impl
from kiln.step_schema import StepSchema

from ..artifact import Artifact
from ..device_support import uses_references
from ..startup import StartupTimer
from .step_streams import StepStreams

@dataclass
class StepInputs:
    """One step's inputs: a tensor per step-schema field (int32, on the executor's device), and the
    host-side bounds the kernels size their launches by: the longest sequence's new tokens and context."""

    feeds: dict[str, torch.Tensor]
    max_q_len: int
    max_kv_len: int

    def sizes(self, schema: StepSchema) -> dict[str, int]:
        """The step's symbol sizes: each axis' length, each table's columns, and the two bounds."""
        sizes = {axis: self.feeds[name].shape[0] for axis, name in schema.size_fields().items()}
        for table in schema.tables():
            sizes[table.columns] = self.feeds[table.name].shape[1]
        sizes.update(max_q_len=self.max_q_len, max_kv_len=self.max_kv_len)
        return sizes


@dataclass(frozen=True)
class StepResult:
    """What a step returns: its outputs by name (a row for each logits row; ``logits`` always, others
    as the step schema declares), and the greedy tokens when the step computed them on the device
    (decode graphs); views valid until the next step."""

    outputs: dict[str, torch.Tensor]
    greedy: torch.Tensor | None

    @property
    def logits(self) -> torch.Tensor:
        return self.outputs["logits"]


def kernel_table(artifact: Artifact, device: torch.device, references: bool = False) -> dict[str, Callable]:
    """Each kernel the program names, as a callable: registry kernels by name, generated ones from
    the artifact's ``kernels/``, each bound to the artifact's ``KernelConfig`` when it reads one
    (generated kernels always do). Triton kernels on a CPU without the interpreter fall back to their
    op's torch reference, so every artifact runs anywhere; with ``references`` they always do (a GPU
    that cannot run the artifact's FP8: ``device_support.uses_references``)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    triton_runs = (device.type == "cuda" or interpreted) and not references
    config = artifact.kernel_config
    generated: dict[str, str] = artifact.manifest.get("generated_kernels", {})
    table = {}
    for name in artifact.manifest["kernels"]:
        if name.startswith(GENERATED_KERNEL_PREFIX):
            table[name] = partial(load_generated(artifact.path / generated_kernel_file(name)), config=config) \
                if triton_runs else get_impl(f"torch.{generated[name]}").fn
            continue
        chosen = impl = get_impl(name)
        if chosen.backend == "triton" and not triton_runs:
            impl = _reference_of(chosen)
        # The program passes `sizes` only to kernels that asked for it at compile time.
        fn = impl.bound(config)
        table[name] = _drop_sizes(fn) if chosen.wants_sizes and not impl.wants_sizes else fn
    return table


def _reference_of(impl: KernelImpl) -> KernelImpl:
    """The torch reference computing what ``impl`` does: the one of its own variant where there is one
    (``triton.linear.fp8_channel`` -> ``torch.linear.fp8_channel``), else its op's."""
    try:
        return get_impl(f"torch.{impl.name.split('.', 1)[1]}")
    except LookupError:
        return get_impl(f"torch.{impl.op}")


def graph_blockers(artifact: Artifact, references: bool = False) -> list[str]:
    """The program's kernels that copy device values to the host mid-step when run on a GPU (torch
    references such as the attention's, in artifacts compiled for the torch backend): a step that
    runs one cannot be captured as a CUDA graph. Generated kernels are Triton and never do; with
    ``references`` (``kernel_table``'s) every kernel runs its torch reference."""
    if references:
        return [name for name in artifact.manifest["kernels"] if not name.startswith(GENERATED_KERNEL_PREFIX)
                and _reference_of(get_impl(name)).reads_device]
    return [name for name in artifact.manifest["kernels"]
            if not name.startswith(GENERATED_KERNEL_PREFIX) and get_impl(name).reads_device]


def load_generated(file: Path) -> Callable:
    spec = importlib.util.spec_from_file_location(f"kiln_generated_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.launch


def _drop_sizes(fn: Callable) -> Callable:
    def call(*args, sizes=None, **kwargs):
        return fn(*args, **kwargs)

    return call


class Executor:
    def __init__(self, artifact: Artifact, device: torch.device | str, rank: int = 0,
                 reference_fallback: bool = False, startup: StartupTimer | None = None) -> None:
        startup = startup or StartupTimer("engine")
        self.device = torch.device(device)
        references = uses_references(artifact, self.device, reference_fallback)
        self.artifact = artifact
        with startup.phase("weights_load"):
            self.weights = artifact.load_weights(self.device, rank)
        plan = artifact.manifest["memory_plan"]
        self.bounds: dict[str, int] = plan["bounds"]
        self.page_size: int = artifact.runtime["page_size"]
        self.schema = artifact.step_schema
        self.arena = torch.empty(plan["arena_bytes"], dtype=torch.uint8, device=self.device)
        with startup.phase("kernel_load"):
            self.step_fn = artifact.program.bind(kernel_table(artifact, self.device, references),
                                                 StepStreams(self.device, artifact.kernel_config.side_stream))

    def arena_view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        count = 1
        for d in shape:
            count *= d
        nbytes = count * dtype.itemsize
        return self.arena[offset:offset + nbytes].view(dtype).view(shape)

    def run(self, inputs: StepInputs, kv_views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        sizes = inputs.sizes(self.schema)
        for symbol, bound in self.bounds.items():
            if sizes.get(symbol, 0) > bound:
                raise ValueError(f"step has {symbol}={sizes[symbol]}, the artifact was compiled for at most {bound}")
        feeds = dict(inputs.feeds)
        feeds.update(kv_views)
        return self.step_fn(self.weights, feeds, self.arena_view, sizes)
