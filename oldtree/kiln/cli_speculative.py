"""The ``--speculative-*`` flags (SGLang's names) of ``kiln serve``, ``generate`` and ``chat``, and the
``EngineOptions``/``Engine`` keywords of the same names they turn into (checked when the engine
starts, by ``runtime.spec.config.SpecConfig``)."""

from __future__ import annotations

import argparse
from typing import Any

from kiln.runtime.spec.config import KNOWN_ALGORITHMS

# Flag -> (type, help); the keyword is the flag's name with underscores.
_FLAGS = {
    "--speculative-algorithm": (str, f"draft tokens and verify them in one step: {'|'.join(KNOWN_ALGORITHMS)} "
                                     "(ngram: looked up in the request's own prompt and output; default off)"),
    "--speculative-num-draft-tokens": (int, "draft tokens per request per step (default 4)"),
    "--speculative-num-steps": (int, "draft-model steps per verify step (EAGLE)"),
    "--speculative-eagle-topk": (int, "branches per draft step (EAGLE; ngram: 1)"),
    "--speculative-draft-model-path": (str, "the draft head's checkpoint directory (EAGLE)"),
    "--speculative-ngram-min-match-window-size": (int, "shortest suffix the n-gram lookup matches (default 1)"),
    "--speculative-ngram-max-match-window-size": (int, "longest suffix the n-gram lookup matches (default 12)"),
}


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    for flag, (kind, help_text) in _FLAGS.items():
        parser.add_argument(flag, type=kind, default=None, help=help_text)


def speculative_keywords(args: argparse.Namespace) -> dict[str, Any]:
    """The flags given, as ``EngineOptions``/``Engine`` keywords (unset ones left to their defaults)."""
    names = (flag[2:].replace("-", "_") for flag in _FLAGS)
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}
