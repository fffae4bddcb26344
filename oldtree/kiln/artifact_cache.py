"""Compile on first use: a model path or alias becomes a cached artifact under ``KILN_HOME/artifacts``.

An artifact directory is used as it is. Anything else is compiled once per (source fingerprint,
compile options) and reused afterwards, so ``kiln serve smollm2-135m-instruct`` and
``Engine("smollm2-135m-instruct")`` pay the compile only the first time.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from kiln import __version__
from kiln.artifact_format import FORMAT_VERSION, MANIFEST
from kiln.paths import kiln_home
from kiln.runtime.spec.config import verify_tokens


def is_artifact(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def ensure_artifact(model: str | Path, options) -> Path:
    """The artifact for ``model`` under ``options`` (a ``CompileOptions``), compiling it if needed."""
    if is_artifact(model):
        return Path(model)
    from kiln.compiler.compile import load_source

    return _compiled(model, load_source(model), options, {})


def ensure_model_artifacts(model: str | Path, options, speculative: dict[str, Any]) -> tuple[Path, str | None]:
    """(the artifact to serve, the draft path the engine options take) under the ``speculative_*``
    keywords given: for an EAGLE algorithm with a draft head, both compiled
    (``ensure_speculative_artifacts``) and the draft's artifact given; otherwise the model's artifact
    and the draft path as it was (the engine refuses what cannot work). With speculation, a model
    compiled here returns logits for every token a full batch verifies, unless ``options`` set it."""
    algorithm, draft_path = speculative.get("speculative_algorithm"), speculative.get("speculative_draft_model_path")
    if algorithm is not None and options.max_logit_rows is None:
        # Every running request may verify in one step, its drafts and its last token each wanting a row
        # of logits: with the default (one row a sequence) a step verifies for a few requests only and
        # leaves the rest without drafts, and the step misses the verify graphs.
        rows = options.max_batch_size * verify_tokens(speculative)
        options = replace(options, max_logit_rows=min(rows, options.max_batch_tokens))
    if algorithm in ("eagle", "eagle3") and draft_path is not None:
        target, draft = ensure_speculative_artifacts(model, draft_path, algorithm, options)
        return target, str(draft)
    return ensure_artifact(model, options), draft_path


def ensure_speculative_artifacts(model: str | Path, draft_path: str | Path, algorithm: str, options) -> tuple[Path, Path]:
    """(target artifact, draft artifact) for an EAGLE head: the target compiled to also return the
    features the head reads (``expose_hidden_states``), the head compiled against it (sharing its
    embedding and, for EAGLE, its lm_head). The target must be a model source, not an artifact."""
    if is_artifact(model):
        raise ValueError(f"speculative_algorithm {algorithm!r}: {model} is a compiled artifact; give the model's "
                         "source (the target is compiled to return the hidden states the draft head reads)")
    if options.pp > 1 or options.max_loras:
        # The head reads the target's last-layer features on the scheduler's rank (a pipelined
        # artifact returns only the logits there), and drafts for the base model, not an adapter.
        what = f"pp={options.pp} (pipeline parallelism)" if options.pp > 1 else f"max_loras={options.max_loras} (LoRA)"
        raise ValueError(f"speculative_algorithm {algorithm!r} with {what} is not supported; EAGLE heads run with "
                         "pp=1 and no LoRA slots")
    from kiln.compiler.compile import load_source
    from kiln.compiler.sources.eagle import load_draft_source

    target = load_source(model)
    draft = load_draft_source(draft_path, target, algorithm)
    # Both attend through a tree mask: verify steps and draft steps of EAGLE-2's dynamic trees.
    target_options = replace(options, step_outputs=tuple(dict.fromkeys(options.step_outputs + (draft.target_output,))),
                             aux_hidden_layers=draft.aux_hidden_layers or options.aux_hidden_layers,
                             tree_attention=True)
    max_seq_len = options.max_seq_len or int(target.config.get("max_position_embeddings", 4096))
    draft_options = replace(options, step_outputs=("hidden_states", "draft_tokens"), aux_hidden_layers=(),
                            max_seq_len=max_seq_len, quantization=None, tp=1, ep=1, expert_placement=(),
                            kv_cache_dtype="auto", kv_cache_scales=(), tree_attention=True)
    return (_compiled(model, target, target_options, {}),
            _compiled(draft_path, draft.source, draft_options, {"target": target.fingerprint, "algorithm": algorithm},
                      draft.source))


def _compiled(model: str | Path, source, options, extra: dict, compile_from=None) -> Path:
    """``model`` (or ``compile_from``, a source made from it) compiled under ``options`` into the
    cache, once per ``source``'s fingerprint, the options and ``extra``."""
    from kiln.compiler.compile import compile_model

    # The format version too: an artifact cached by an older kiln of the same version number would be
    # refused by this one's loader rather than recompiled.
    key = json.dumps({"fingerprint": source.fingerprint, "options": options.to_json(), "kiln": __version__,
                      "format": FORMAT_VERSION, **extra}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    slug = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(str(model)).name or "model")
    target = kiln_home() / "artifacts" / f"{slug}-{digest}.kiln"
    if is_artifact(target):
        return target
    return compile_model(model if compile_from is None else compile_from, target, options)


def artifact_model_name(path: str | Path) -> str:
    """The model's own name recorded in an artifact (an alias, or the source directory's name); for
    artifacts compiled before the name was recorded, the same rule applied to the recorded source."""
    model = json.loads((Path(path) / MANIFEST).read_text())["model"]
    if model.get("name"):
        return model["name"]
    source = Path(model["source"])
    return source.stem if source.suffix == ".gguf" else source.name
