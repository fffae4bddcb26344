"""kiln: a compiler-centric LLM inference and serving engine.

The public API: ``Engine`` (in-process generation), ``SamplingParams``, and ``compile`` (a model
into an artifact directory).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.3.0"
__all__ = ["Engine", "SamplingParams", "compile", "__version__"]

if TYPE_CHECKING:
    from kiln.engine import Engine
    from kiln.runtime.sampling import SamplingParams


def compile(model: str, output: str, **options: Any):
    """Compiles ``model`` (HF dir, GGUF file or alias) into the artifact directory ``output``."""
    from kiln.compiler.compile import compile_model
    from kiln.compiler.options import CompileOptions

    return compile_model(model, output, CompileOptions(**options))


def __getattr__(name: str) -> Any:
    # Imported on first use: `import kiln` stays light for tools that only need the compiler.
    if name == "Engine":
        from kiln.engine import Engine

        return Engine
    if name == "SamplingParams":
        from kiln.runtime.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")
