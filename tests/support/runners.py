"""A small compiled model's ModelRunner on the CPU, with prefill graphs on (their padded path runs
eagerly over the same static buffers a GPU captures): what the worker tests drive by hand."""

from __future__ import annotations

from pathlib import Path

from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.engine_options import EngineOptions
from kiln.runtime.worker.model_runner import ModelRunner

from .hf_models import make_hf_model

PAGE = 4


def cpu_runner(directory: Path, kind: str = "llama3", kv_cache_tokens: int = 256, **options) -> ModelRunner:
    """Compiles a random ``kind`` model (f32, page size 4) with ``options`` into ``directory``."""
    options = {"dtype": "fp32", "page_size": PAGE, "max_batch_tokens": 32, "max_batch_size": 4, "max_seq_len": 32,
               **options}
    artifact = compile_model(make_hf_model(kind, directory / "src"), directory / "m.kiln", CompileOptions(**options))
    core = EngineCore(str(artifact), EngineOptions(device="cpu", kv_cache_tokens=kv_cache_tokens, prefill_graphs=True))
    return core.runner
