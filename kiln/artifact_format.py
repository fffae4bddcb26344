"""The artifact's layout: the contract between the compiler (writer) and the runtime (reader).

Neither side imports the other; both import this. ``docs/artifact.md`` describes the format.
"""

from __future__ import annotations

# 3: the runtime section records ``tp`` and each rank's ``num_kv_heads``; a tensor-parallel artifact
# holds a weights file per rank, and a reader that ignored that would run one rank's shard alone.
# 4: the runtime section records ``pp``, ``ep`` and ``ranks`` (pp x max(tp, ep)); a pipelined artifact
# (pp > 1) holds each stage's graph and program under stages/{s}/; every rank has its weights file
# (stage * max(tp, ep) + the rank within its stage), which a version-3 reader would run on one rank.
# 5: a LoRA artifact's hooks read the step's rows grouped by adapter once (the ``lora_groups`` op's
# ``lora_rows``/``lora_tiles``) where version 4's read each row's slot: a version-4 program would fail
# on its first LoRA step.
# 6: the program's ``bind`` takes the step's streams beside the kernels, and a LoRA hook is two ops
# (``lora_shrink`` on the side stream, ``lora_expand``) where version 5's was one ``lora``: a
# version-5 reader would call ``bind`` without the streams.
FORMAT_VERSION = 6
MANIFEST = "manifest.json"
GRAPH_TEXT = "graph.txt"
GRAPH_JSON = "graph.json"
PROGRAM = "program.py"
KERNELS_DIR = "kernels"
WEIGHTS_DIR = "weights"
TOKENIZER_DIR = "tokenizer"
# Kernels the compiler generates are named "generated.<module>" in the program's kernel table; the
# module lives at kernels/<module>.py and exposes `launch`. The manifest maps each name to its op.
GENERATED_KERNEL_PREFIX = "generated."


def generated_kernel_file(name: str) -> str:
    return f"{KERNELS_DIR}/{name[len(GENERATED_KERNEL_PREFIX):]}.py"


def stage_dir(stage: int) -> str:
    """Where a pipelined artifact keeps stage ``stage``'s graph and program."""
    return f"stages/{stage}"


def weights_file(rank: int) -> str:
    return f"{WEIGHTS_DIR}/rank{rank}.safetensors"
