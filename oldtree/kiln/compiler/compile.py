"""``compile_model``: source -> graph -> passes -> codegen -> an artifact directory.

The artifact is written into a temporary directory beside the target and renamed into place at
the end, so a failed compile never leaves a half-written artifact where a good one is expected.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import save_file

from kiln import __version__
from kiln.artifact_format import (FORMAT_VERSION, GRAPH_JSON, GRAPH_TEXT, KERNELS_DIR, MANIFEST, PROGRAM,
                                  TOKENIZER_DIR, generated_kernel_file, stage_dir, weights_file)
from kiln.ir import Graph, print_graph
from kiln.ir.serialize import dumps
from kiln.models import BuildOptions, family_for
from kiln.tensors import parse_float_dtype

from .codegen.program import generate_program
from .options import CompileOptions
from .passes.base import PassContext
from .passes.count_expert_load import PREFIX as EXPERT_LOAD
from .passes.quantize_kv_cache import KV_CACHE_DTYPES
from .passes.split_pipeline import stage_layers
from .pipeline import run_pipeline
from .quantization import METHODS, QuantizationMethod, get_method
from .sources.hf import ModelSource, load_hf_dir
from .weights import WeightStore


def load_source(model: str | Path | ModelSource) -> ModelSource:
    """An HF directory, a GGUF file or an alias, as a model source (a ModelSource passes through)."""
    if isinstance(model, ModelSource):
        return model
    path = Path(model)
    if path.is_dir():
        return load_hf_dir(path)
    from .sources.aliases import resolve_model

    return load_hf_dir(resolve_model(model))


def compile_model(model: str | Path | ModelSource, out: str | Path, options: CompileOptions | None = None,
                  dump_ir: Path | None = None) -> Path:
    options = options or CompileOptions()
    options.validate()
    started = time.perf_counter()
    source = load_source(model)
    family = family_for(source.config)
    dtype = parse_float_dtype(options.dtype)
    built = family.build(source.config, BuildOptions(dtype, options.page_size, options.max_seq_len,
                                                          options.step_schema()))
    max_seq_len = built.max_seq_len
    bounds = {
        "T": options.max_batch_tokens,
        "B": options.max_batch_size,
        "N": options.max_logit_rows or options.max_batch_size,
        "P": -(-max_seq_len // options.page_size),
    }
    quantization = _quantization(options.quantization, source, options.quantize_lm_head)
    stages = []
    for stage in range(options.pp):  # one run of the passes per pipeline stage (passes/split_pipeline.py)
        ctx = PassContext(backend=options.backend, symbol_bounds=bounds, recipes=list(built.recipes),
                          quantization=quantization, quantize_lm_head=options.quantize_lm_head, tp=options.tp,
                          pp=options.pp, stage=stage, ep=options.ep,
                          expert_placement=options.expert_placement, kv_cache_dtype=options.kv_cache_dtype,
                          kv_cache_scales=options.kv_cache_scales, lora=options.lora_layout(),
                          step_outputs=options.step_outputs, aux_hidden_layers=options.aux_hidden_layers)
        dump = dump_ir if dump_ir is None or options.pp == 1 else dump_ir / stage_dir(stage)
        graph, pass_log = run_pipeline(built.graph, ctx, dump_dir=dump, skip=options.skip_passes)
        store = WeightStore(source.tensors, built.computed, ctx.recipes, str(source.path))
        store.check_available(graph)
        stages.append(_Stage(graph, ctx, pass_log, store))
    generated_kernels = _generated_kernels(stages)

    out = Path(out)
    if out.exists() and not (out / MANIFEST).is_file():
        raise FileExistsError(f"{out}: exists and is not a kiln artifact; not overwriting it")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (staging / KERNELS_DIR).mkdir()
        (staging / weights_file(0)).parent.mkdir()
        for index, stage in enumerate(stages):
            files = staging / (stage_dir(index) if options.pp > 1 else "")
            files.mkdir(parents=True, exist_ok=True)
            for shard in range(options.stage_ranks):  # rank R = stage * stage_ranks + shard
                save_file(dict(stage.store.materialize(stage.graph, shard)),
                          str(staging / weights_file(index * options.stage_ranks + shard)))
            (files / GRAPH_TEXT).write_text(print_graph(stage.graph))
            (files / GRAPH_JSON).write_text(dumps(stage.graph))
            (files / PROGRAM).write_text(generate_program(stage.graph, stage.ctx.kernel_choice,
                                                          stage.ctx.memory_plan))
        for name, (_, kernel_source) in generated_kernels.items():
            (staging / generated_kernel_file(name)).write_text(kernel_source)
        tokenizer = _copy_tokenizer(source, staging / TOKENIZER_DIR)
        manifest = {
            "format_version": FORMAT_VERSION,
            "kiln_version": __version__,
            "model": {
                "name": model_name(model, source),
                "source": str(source.path) if isinstance(model, ModelSource) else str(model),
                "fingerprint": source.fingerprint,
                "architecture": built.graph.name,
                "config": source.config,
            },
            "options": options.to_json(),
            "quantization": None if quantization is None else {
                "method": quantization.name, "scheme": quantization.scheme.name, "act_quant": quantization.act_quant,
                "checkpoint": None if source.quantization is None else source.quantization.description},
            "runtime": {
                "num_layers": built.num_layers,
                "tp": options.tp,
                "pp": options.pp,
                "ep": options.ep,
                "ranks": options.ranks,  # the processes it runs on, each with its weights file
                "num_kv_heads": _kv_heads(stages[0].graph),  # each rank's (shard_tp splits them)
                "head_dim": built.head_dim,
                "vocab_size": built.vocab_size,
                "max_seq_len": max_seq_len,
                "page_size": options.page_size,
                "dtype": str(dtype),
                "kv_cache_dtype": str(KV_CACHE_DTYPES[options.kv_cache_dtype] or dtype),  # the pool's
                "symbol_bounds": bounds,
                "step_schema": options.step_schema().to_json(),
                # The per-layer expert counters the runtime keeps (passes/count_expert_load.py).
                "expert_load": [{"input": name, "layer": int(name[len(EXPERT_LOAD):]), "experts": t.shape[0]}
                                for name, t in stages[0].graph.inputs.items() if name.startswith(EXPERT_LOAD)],
            },
            "lora": stages[0].ctx.lora.to_json() if stages[0].ctx.lora is not None else None,
            "memory_plan": stages[0].ctx.memory_plan.to_json(),
            "kernels": sorted({name for stage in stages for name in stage.ctx.kernel_choice}),
            "generated_kernels": {name: op for name, (op, _) in generated_kernels.items()},
            "passes": stages[0].pass_log,
            "weights": [weights_file(rank) for rank in range(options.ranks)],
            "tokenizer": TOKENIZER_DIR if tokenizer else None,
            "compile_seconds": round(time.perf_counter() - started, 3),
        }
        if options.pp > 1:
            manifest["stages"] = [_stage_entry(index, stage, built.num_layers, options.pp)
                                  for index, stage in enumerate(stages)]
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


@dataclass(frozen=True)
class _Stage:
    """One pipeline stage's compiled graph, the context its passes ran in, their log, its weights."""

    graph: Graph
    ctx: PassContext
    pass_log: list[dict]
    store: WeightStore


def _stage_entry(index: int, stage: _Stage, num_layers: int, pp: int) -> dict:
    """The manifest's record of a pipeline stage: where its files are, its layers (and KV caches), its
    memory plan and pass log."""
    layers = stage_layers(num_layers, pp, index)
    return {"dir": stage_dir(index), "layers": [layers.start, layers.stop], "num_kv_heads": _kv_heads(stage.graph),
            "memory_plan": stage.ctx.memory_plan.to_json(), "passes": stage.pass_log}


def _kv_heads(graph: Graph) -> int:
    """The KV heads a rank's pool holds: the heads of the graph's first KV cache."""
    return next(t.shape[1] for name, t in graph.inputs.items() if name.startswith("k_cache."))


def _generated_kernels(stages: list[_Stage]) -> dict[str, tuple[str, str]]:
    """Every stage's generated kernels by name; stages generating one name generate the same source."""
    kernels: dict[str, tuple[str, str]] = {}
    for stage in stages:
        for name, kernel in stage.ctx.generated_kernels.items():
            if kernels.setdefault(name, kernel) != kernel:
                raise ValueError(f"generated kernel {name}: two pipeline stages generate different sources")
    return kernels


def _quantization(requested: str | None, source: ModelSource, quantize_lm_head: bool) -> QuantizationMethod | None:
    """The method the quantize pass applies: the one asked for, or a pre-quantized checkpoint's own
    (asking for another would requantize its weights, which kiln refuses)."""
    checkpoint = source.quantization
    if checkpoint is None:
        if requested is None and quantize_lm_head:
            raise ValueError(f"quantize_lm_head: the lm_head is quantized by the model's quantization method, and "
                             f"none was given; give quantization too ({', '.join(METHODS)})")
        return None if requested is None else get_method(requested)
    if requested not in (None, checkpoint.method.name):
        raise ValueError(f"{source.path}: the checkpoint is already quantized ({checkpoint.description}); "
                         f"quantization {requested!r} would requantize it. Leave the quantization out or give "
                         f"{checkpoint.method.name!r}")
    return checkpoint.method


def model_name(model: str | Path | ModelSource, source: ModelSource) -> str:
    """The model's own name, which ``kiln serve`` serves it as: an alias as typed, else the source
    directory's (or GGUF file's) name."""
    path = Path(source.path if isinstance(model, ModelSource) else model).expanduser()
    if not path.exists():
        return str(model)  # an alias
    path = path.resolve()
    return path.stem if path.suffix == ".gguf" else path.name


def _copy_tokenizer(source: ModelSource, target: Path) -> bool:
    """Copies the tokenizer files; a source without tokenizer.json serves token ids only."""
    if not any(f.name == "tokenizer.json" for f in source.tokenizer_files):
        return False
    target.mkdir()
    for file in source.tokenizer_files:
        shutil.copy2(file, target / file.name)
    return True
