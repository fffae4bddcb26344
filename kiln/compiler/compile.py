"""``compile_model``: source -> graph -> passes -> codegen -> an artifact directory.

The artifact is written into a temporary directory beside the target and renamed into place at
the end, so a failed compile never leaves a half-written artifact where a good one is expected.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

from safetensors.torch import save_file

from kiln import __version__
from kiln.artifact_format import (FORMAT_VERSION, GRAPH_JSON, GRAPH_TEXT, KERNELS_DIR, MANIFEST, PROGRAM,
                                  TOKENIZER_DIR, generated_kernel_file, weights_file)
from kiln.ir import print_graph
from kiln.ir.serialize import dumps
from kiln.models import BuildOptions, family_for
from kiln.tensors import parse_float_dtype

from .codegen.program import generate_program
from .options import CompileOptions
from .passes.base import PassContext
from .passes.quantize_kv_cache import KV_CACHE_DTYPES
from .pipeline import run_pipeline
from .quantization import QuantizationMethod, get_method
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
    quantization = _quantization(options.quantization, source)
    ctx = PassContext(backend=options.backend, symbol_bounds=bounds, recipes=list(built.recipes),
                      quantization=quantization, tp=options.tp, kv_cache_dtype=options.kv_cache_dtype,
                      kv_cache_scales=options.kv_cache_scales, step_outputs=options.step_outputs,
                      aux_hidden_layers=options.aux_hidden_layers)
    graph, pass_log = run_pipeline(built.graph, ctx, dump_dir=dump_ir, skip=options.skip_passes)

    store = WeightStore(source.tensors, built.computed, ctx.recipes, str(source.path))
    store.check_available(graph)

    out = Path(out)
    if out.exists() and not (out / MANIFEST).is_file():
        raise FileExistsError(f"{out}: exists and is not a kiln artifact; not overwriting it")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (staging / KERNELS_DIR).mkdir()
        (staging / weights_file(0)).parent.mkdir()
        for rank in range(options.tp):
            save_file(dict(store.materialize(graph, rank)), str(staging / weights_file(rank)))
        (staging / GRAPH_TEXT).write_text(print_graph(graph))
        (staging / GRAPH_JSON).write_text(dumps(graph))
        (staging / PROGRAM).write_text(generate_program(graph, ctx.kernel_choice, ctx.memory_plan))
        for name, (_, kernel_source) in ctx.generated_kernels.items():
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
                "num_kv_heads": graph.inputs["k_cache.0"].shape[1],  # each rank's (shard_tp splits them)
                "head_dim": built.head_dim,
                "vocab_size": built.vocab_size,
                "max_seq_len": max_seq_len,
                "page_size": options.page_size,
                "dtype": str(dtype),
                "kv_cache_dtype": str(KV_CACHE_DTYPES[options.kv_cache_dtype] or dtype),  # the pool's
                "symbol_bounds": bounds,
                "step_schema": options.step_schema().to_json(),
            },
            "memory_plan": ctx.memory_plan.to_json(),
            "kernels": sorted(set(ctx.kernel_choice)),
            "generated_kernels": {name: op for name, (op, _) in ctx.generated_kernels.items()},
            "passes": pass_log,
            "weights": [weights_file(rank) for rank in range(options.tp)],
            "tokenizer": TOKENIZER_DIR if tokenizer else None,
            "compile_seconds": round(time.perf_counter() - started, 3),
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _quantization(requested: str | None, source: ModelSource) -> QuantizationMethod | None:
    """The method the quantize pass applies: the one asked for, or a pre-quantized checkpoint's own
    (asking for another would requantize its weights, which kiln refuses)."""
    checkpoint = source.quantization
    if checkpoint is None:
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
