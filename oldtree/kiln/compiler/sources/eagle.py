"""An EAGLE draft head's checkpoint as a model source, checked against its target.

Published heads (SafeAILab/EAGLE, EAGLE-3) hold the draft layer(s), ``fc`` and (EAGLE-3) ``norm``,
``lm_head``, ``d2t``/``t2d``, under names with or without a ``model.`` prefix; most leave out the
embedding (and EAGLE's lm_head), which the target provides. This source gives the draft the names
``models/eagle.py`` declares: its own tensors with the prefix dropped, the target's embedding as
``embed_tokens.weight`` and its head as ``lm_head.weight`` where the draft has none. The config's
architecture is set from the algorithm (EAGLE checkpoints call themselves ``LlamaForCausalLM``).

What cannot work is refused here, naming it: a hidden size or vocabulary that does not fit the
target, a head of the other EAGLE version, an EAGLE-3 draft vocabulary without its ``d2t`` map.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kiln.models.eagle import EAGLE, EAGLE3

from .hf import CheckpointTensors, ModelSource, SourceError, load_hf_dir

ALGORITHMS = {"eagle": EAGLE, "eagle3": EAGLE3}


class DraftTensors(CheckpointTensors):
    """The draft's tensors under the draft graph's names: each name maps to (tensors, name there)."""

    def __init__(self, sources: dict[str, tuple[CheckpointTensors, str]]) -> None:
        super().__init__({name: tensors.file_of(there) for name, (tensors, there) in sources.items()})
        self._sources = sources

    def get(self, name: str) -> torch.Tensor:
        tensors, there = self._sources[name]
        return tensors.get(there)


@dataclass(frozen=True)
class DraftSource:
    source: ModelSource
    # What the target must expose for this head (a step output name), and EAGLE-3's layers (() for EAGLE).
    target_output: str
    aux_hidden_layers: tuple[int, ...]


def load_draft_source(path: str | Path, target: ModelSource, algorithm: str) -> DraftSource:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"speculative_algorithm {algorithm!r} has no draft head; draft heads: {', '.join(ALGORITHMS)}")
    draft = load_hf_dir(Path(path))
    where = f"speculative_draft_model_path {draft.path}"
    names = {name.removeprefix("model."): name for name in draft.tensors.names()}
    sources = {name: (draft.tensors, there) for name, there in names.items() if name not in ("t2d",)}
    config, target_config = dict(draft.config), target.config
    hidden, target_hidden = int(config["hidden_size"]), int(target_config["hidden_size"])
    if algorithm == "eagle3":
        declared = int(config.get("target_hidden_size") or hidden)
        if declared != target_hidden:
            raise ValueError(f"{where}: the EAGLE-3 head reads target hidden states of size {declared}, the target's "
                             f"hidden size is {target_hidden}")
    elif hidden != target_hidden:
        raise ValueError(f"{where}: the draft's hidden size {hidden} does not fit the target's {target_hidden}")
    if int(config["vocab_size"]) != int(target_config["vocab_size"]):
        raise ValueError(f"{where}: the draft's vocabulary ({config['vocab_size']} tokens) is not the target's "
                         f"({target_config['vocab_size']})")
    if "fc.weight" not in sources:
        raise ValueError(f"{where}: no fc.weight: not an EAGLE head in the published layout")
    fc_in = sources["fc.weight"][0].get(sources["fc.weight"][1]).shape[1]
    expected = 3 * target_hidden if algorithm == "eagle3" else 2 * hidden
    if fc_in != expected:
        other = "eagle" if algorithm == "eagle3" else "eagle3"
        raise ValueError(f"{where}: fc.weight reads {fc_in} features, speculative_algorithm {algorithm!r} needs "
                         f"{expected}; is it an {other!r} head?")
    aux_layers: tuple[int, ...] = ()
    if algorithm == "eagle3":
        if "fc.bias" in sources:
            raise ValueError(f"{where}: fc.bias is not supported for EAGLE-3 heads (none is published with one)")
        draft_vocab = int(config.get("draft_vocab_size") or config["vocab_size"])
        if draft_vocab != int(config["vocab_size"]) and "d2t" not in sources:
            raise ValueError(f"{where}: a draft vocabulary of {draft_vocab} tokens needs its d2t map; the checkpoint "
                             "has none")
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        aux_layers = tuple(int(i) + 1 for i in ids) if ids else ()  # SGLang: the input of the layer after each
    config["architectures"] = [ALGORITHMS[algorithm]]
    config["bias"] = "fc.bias" in sources
    _share(sources, "embed_tokens.weight", target, ("model.embed_tokens.weight",))
    if algorithm == "eagle" or "lm_head.weight" not in sources:
        _share(sources, "lm_head.weight", target, ("lm_head.weight", "model.embed_tokens.weight"), replace_own=True)
    target_output = "aux_hidden_states" if algorithm == "eagle3" else "token_hidden_states"
    return DraftSource(replace(draft, config=config, tensors=DraftTensors(sources)), target_output, aux_layers)


def _share(sources: dict, name: str, target: ModelSource, candidates: tuple[str, ...], replace_own: bool = False) -> None:
    """Gives the draft the target's tensor (the first of ``candidates`` the target has) as ``name``,
    unless the draft has its own (or, with ``replace_own``, always: EAGLE shares the target's head)."""
    if name in sources and not replace_own:
        return
    for there in candidates:
        if there in target.tensors:
            sources[name] = (target.tensors, there)
            return
    if name not in sources:
        raise SourceError(f"{target.path}: has none of {', '.join(candidates)} for the draft's {name}")
