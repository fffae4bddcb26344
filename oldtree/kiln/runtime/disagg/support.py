"""What a disaggregated engine runs on, checked before a prefill or decode server starts.

The handoff (``handoff.py``) reads and writes the KV pool of the engine core's own process, so both
sides run on one rank: a tensor-, expert-parallel or pipelined artifact keeps KV heads or layers in
other processes' pools (``--tp``/``--ep``/``--pp``), and so do replicas (``--world-size``) and
other nodes (``--nnodes``). Speculative decoding is refused too: a draft model or EAGLE head keeps
state (its own KV, the target's features) that the handoff does not carry. LoRA adapters are
refused by the server (``server/disaggregation.py``): the handed pages are the base model's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.artifact_format import MANIFEST

from ..engine_options import EngineOptions

if TYPE_CHECKING:
    from ..engine_core import EngineCore


def check_supported(runtime: dict[str, Any], options: EngineOptions) -> None:
    """Raises ValueError naming what a disaggregated engine of this artifact (its manifest's
    ``runtime``) and these options would need that is not supported, and what is."""
    if runtime["ranks"] > 1:
        raise ValueError(f"--disaggregation-mode: runs on one-rank artifacts (tp=1, pp=1, ep=1) for now; this one "
                         f"runs on {runtime['ranks']} ranks (tp={runtime['tp']}, pp={runtime['pp']}, "
                         f"ep={runtime['ep']}): compile it without --tp/--pp/--ep for each side")
    if options.world_size > 1:
        raise ValueError(f"--disaggregation-mode: runs on one rank for now; leave --world-size at 1, "
                         f"not {options.world_size}")
    if options.nnodes > 1:
        raise ValueError(f"--disaggregation-mode: runs on one node; leave --nnodes at 1, not {options.nnodes}")
    if options.speculative_algorithm is not None:
        raise ValueError(f"--disaggregation-mode: speculative decoding (--speculative-algorithm "
                         f"{options.speculative_algorithm}) is not supported with disaggregation; leave it off")


def check_artifact_supported(artifact: str | Path, options: EngineOptions) -> None:
    """``check_supported`` for an artifact directory, from its manifest alone (nothing loaded)."""
    check_supported(json.loads((Path(artifact) / MANIFEST).read_text())["runtime"], options)


def check_core(core: EngineCore) -> None:
    """``check_supported`` for a running engine core."""
    check_supported(core.artifact.runtime, core.options)
