"""The ordered pass list, and the loop that runs it, timing and optionally dumping the IR after each.

The per-token hidden states EAGLE draft heads read are exposed first, on the model's own residual
adds (``expose_hidden_states``), and draft-tree verification's mask handed to the attentions
(``tree_attention``). Transforms rewrite the graph; analyses (kernel selection, memory planning)
leave their results in the context for codegen. The order matters: tensor-parallel sharding comes first, on the graph as
the model wrote it (its patterns are the model's primitive ops); the pipeline split follows (it keeps
one stage's layers: the compiler runs the list once per stage), so no fusion joins ops of two stages;
then expert-parallel sharding of the ``moe`` ops tensor parallelism leaves whole (after their experts
are laid in slots, when a placement asks for copies) and the expert-load counters after each router
(before the fusions, of which only ``fuse_router_count`` joins each counter to its router), so the
fusions see the sharded
GEMMs and the collectives between them; the linear fusions must see the unfused projections,
silu·mul must see the split the gate/up fusion made, the residual adds must join their GEMMs
before silu·mul joins the down GEMM and the norms join theirs, LoRA hooks go on the GEMMs after the
residual adds joined them and before the norms and silu·mul do (hooks read those ops' inputs,
leaving them to their GEMMs), rope+KV store must see the q/k norms before anything else touches them
(and joins the attention after that), quantization sees the GEMMs as they will
run (fused weights are quantized once, whole), as the FP8 KV cache sees the fused attention ops, and
both come before dead-code elimination (which drops the
plain weights it leaves unread) and kernel selection (which picks kernels by the weight's format), and
planning runs last on the final graph.

Experiments leave passes out by name (``CompileOptions.skip_passes``, ``kiln compile --skip-pass``);
the list itself never changes, and the passes the artifact needs (``REQUIRED``) cannot be skipped.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

from kiln.ir import Graph, print_graph, verify

from .passes.base import Pass, PassContext
from .passes.count_expert_load import count_expert_load
from .passes.dce import eliminate_dead_code
from .passes.expose_hidden_states import expose_hidden_states
from .passes.fuse_add_rmsnorm import fuse_add_rmsnorm
from .passes.fuse_linear_residual import fuse_linear_residual
from .passes.fuse_linears import fuse_linears
from .passes.fuse_norm_linear import fuse_norm_linear
from .passes.fuse_rope_attention import fuse_rope_attention
from .passes.fuse_rope_kv_store import fuse_rope_kv_store
from .passes.fuse_router_count import fuse_router_count
from .passes.fuse_silu_mul import fuse_silu_mul
from .passes.fuse_silu_mul_linear import fuse_silu_mul_linear
from .passes.insert_lora import insert_lora
from .passes.place_experts import place_experts
from .passes.plan_memory import plan_memory
from .passes.quantize import quantize
from .passes.quantize_kv_cache import quantize_kv_cache
from .passes.select_kernels import select_kernels
from .passes.shard_ep import shard_ep
from .passes.shard_tp import shard_tp
from .passes.split_pipeline import split_pipeline
from .passes.tree_attention import tree_attention


def _verify(graph: Graph, ctx: PassContext) -> Graph:
    verify(graph)
    return graph


PIPELINE: list[tuple[str, Pass]] = [
    ("verify", _verify),
    ("expose_hidden_states", expose_hidden_states),
    ("tree_attention", tree_attention),
    ("shard_tp", shard_tp),
    ("split_pipeline", split_pipeline),
    ("place_experts", place_experts),
    ("shard_ep", shard_ep),
    ("count_expert_load", count_expert_load),
    ("fuse_router_count", fuse_router_count),
    ("fuse_linears", fuse_linears),
    ("fuse_silu_mul", fuse_silu_mul),
    ("fuse_linear_residual", fuse_linear_residual),
    ("insert_lora", insert_lora),
    ("fuse_silu_mul_linear", fuse_silu_mul_linear),
    ("fuse_norm_linear", fuse_norm_linear),
    ("fuse_add_rmsnorm", fuse_add_rmsnorm),
    ("fuse_rope_kv_store", fuse_rope_kv_store),
    ("fuse_rope_attention", fuse_rope_attention),
    ("quantize", quantize),
    ("quantize_kv_cache", quantize_kv_cache),
    ("dce", eliminate_dead_code),
    ("select_kernels", select_kernels),
    ("plan_memory", plan_memory),
]
# Without these there is no checked graph, no kernel table or no memory plan to write, no rank's
# shard of a tensor- or expert-parallel model or stage of a pipelined one, no LoRA hooks the
# artifact was asked for, no step output the options ask for, or no tree mask its attention reads.
REQUIRED = frozenset({"verify", "expose_hidden_states", "tree_attention", "shard_tp", "split_pipeline", "shard_ep",
                      "insert_lora", "select_kernels", "plan_memory"})


def selected_passes(skip: Sequence[str] = ()) -> list[tuple[int, str, Pass]]:
    """The passes that run when those named in ``skip`` are left out, each with its position in
    ``PIPELINE`` (from 1); refuses names of no pass and of required ones."""
    names = [name for name, _ in PIPELINE]
    unknown = sorted(set(skip) - set(names))
    if unknown:
        raise ValueError(f"cannot skip {', '.join(unknown)}: no such pass; passes: {', '.join(names)}")
    required = sorted(set(skip) & REQUIRED)
    if required:
        raise ValueError(f"cannot skip {', '.join(required)}: every artifact needs it; skippable passes: "
                         f"{', '.join(n for n in names if n not in REQUIRED)}")
    return [(index, name, fn) for index, (name, fn) in enumerate(PIPELINE, start=1) if name not in skip]


def run_pipeline(graph: Graph, ctx: PassContext, dump_dir: Path | None = None, verify_each: bool = True,
                 skip: Sequence[str] = ()) -> tuple[Graph, list[dict]]:
    """Runs the passes in order, less those named in ``skip``; returns the final graph and the pass
    log (name, seconds, node count). Dumps are numbered by the pass's place in ``PIPELINE``, so the
    same file names the same pass whatever was skipped."""
    passes = selected_passes(skip)
    log = []
    if dump_dir is not None:
        dump_dir.mkdir(parents=True, exist_ok=True)
        (dump_dir / "00_input.txt").write_text(print_graph(graph))
    for index, name, fn in passes:
        start = time.perf_counter()
        graph = fn(graph, ctx)
        seconds = time.perf_counter() - start
        if verify_each:
            verify(graph)
        log.append({"pass": name, "seconds": round(seconds, 6), "nodes": len(graph.nodes)})
        if dump_dir is not None:
            (dump_dir / f"{index:02d}_{name}.txt").write_text(print_graph(graph))
    return graph, log
