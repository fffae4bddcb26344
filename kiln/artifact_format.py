"""The artifact's layout: the contract between the compiler (writer) and the runtime (reader).

Neither side imports the other; both import this. ``docs/artifact.md`` describes the format.
"""

from __future__ import annotations

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
GRAPH_TEXT = "graph.txt"
GRAPH_JSON = "graph.json"
PROGRAM = "program.py"
KERNELS_DIR = "kernels"
WEIGHTS_DIR = "weights"
TOKENIZER_DIR = "tokenizer"


def weights_file(rank: int) -> str:
    return f"{WEIGHTS_DIR}/rank{rank}.safetensors"
