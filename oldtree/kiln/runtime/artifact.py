"""Loading an artifact: manifest (format version checked), the generated program, weights, tokenizer dir.

A pipelined artifact (``runtime.pp`` > 1) is loaded one stage at a time: ``load_artifact(path, stage)``
gives the stage's view, whose program, memory plan, layers and KV heads are the stage's own.

The runtime never imports the compiler: everything it needs is in the artifact's files.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors.torch import load_file

from kiln.artifact_format import FORMAT_VERSION, MANIFEST, PROGRAM
from kiln.step_schema import StepSchema
from kiln.kernels.config import KernelConfig, KernelConfigError


class ArtifactError(ValueError):
    """An artifact that cannot be loaded; the message names the file and the problem."""


@dataclass(frozen=True)
class Artifact:
    path: Path
    manifest: dict[str, Any]
    program: ModuleType

    @property
    def runtime(self) -> dict[str, Any]:
        return self.manifest["runtime"]

    @property
    def step_schema(self) -> StepSchema:
        """The step inputs the artifact's program reads (see ``kiln.step_schema``)."""
        return StepSchema.from_json(self.runtime["step_schema"])

    @property
    def kernel_config(self) -> KernelConfig:
        """The kernel tunables the artifact was compiled with, which its kernels run with."""
        try:
            return KernelConfig.from_json(self.manifest["options"]["kernel_config"])
        except KernelConfigError as exc:
            raise ArtifactError(f"{self.path / MANIFEST}: {exc}") from None

    @property
    def layers(self) -> range:
        """The decoder layers this artifact's program runs (and whose KV caches it reads): a stage's
        share in a pipelined artifact, else all of them."""
        first, end = self.runtime.get("layers", (0, self.runtime["num_layers"]))
        return range(first, end)

    @property
    def tokenizer_dir(self) -> Path | None:
        name = self.manifest.get("tokenizer")
        return self.path / name if name else None

    def weight_bytes(self, rank: int = 0) -> int:
        """The size of ``rank``'s weights file: what loading them puts on its device."""
        return (self.path / self.manifest["weights"][rank]).stat().st_size

    def load_weights(self, device: torch.device | str, rank: int = 0) -> dict[str, torch.Tensor]:
        file = self.path / self.manifest["weights"][rank]
        try:
            return load_file(str(file), device=str(device))
        except Exception as exc:
            raise ArtifactError(f"{file}: cannot load weights: {exc}") from None


def load_artifact(path: str | Path, stage: int = 0) -> Artifact:
    """The artifact at ``path``; for a pipelined one, the view of pipeline stage ``stage``."""
    path = Path(path)
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        raise ArtifactError(f"{path}: not a kiln artifact (no {MANIFEST})")
    try:
        manifest = json.loads(manifest_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{manifest_file}: not valid JSON: {exc}") from None
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(f"{manifest_file}: artifact format version {version!r}, this kiln reads version "
                            f"{FORMAT_VERSION}; recompile the model with this kiln")
    stages = manifest.get("stages")
    if stages is None:
        if stage != 0:
            raise ArtifactError(f"{manifest_file}: the artifact has one pipeline stage, not a stage {stage}")
        return Artifact(path, manifest, _load_program(path / PROGRAM))
    if not 0 <= stage < len(stages):
        raise ArtifactError(f"{manifest_file}: the artifact has {len(stages)} pipeline stages, not a stage {stage}")
    entry = stages[stage]
    runtime = {**manifest["runtime"], "stage": stage, "layers": entry["layers"], "num_kv_heads": entry["num_kv_heads"]}
    manifest = {**manifest, "runtime": runtime, "memory_plan": entry["memory_plan"]}
    return Artifact(path, manifest, _load_program(path / entry["dir"] / PROGRAM))


def _load_program(file: Path) -> ModuleType:
    if not file.is_file():
        raise ArtifactError(f"{file}: missing")
    spec = importlib.util.spec_from_file_location(f"kiln_program_{abs(hash(str(file)))}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        raise ArtifactError(f"{file}: not a valid program: {exc}") from None
    return module
