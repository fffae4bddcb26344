"""On a GPU: the first start of an artifact saves the Triton kernels it compiled into the artifact
(``kernels/triton-<version>-<arch>/``), and a second start on an empty user Triton cache (a fresh
machine) compiles none: Triton writes nothing into its cache. Each start is its own process (Triton
keeps compiled kernels in memory too). The phases' seconds are printed (``kernel_warmup`` falls),
not asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.e2e.test_gpu import compile_random

pytestmark = pytest.mark.gpu

START = """
import json, sys
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.engine_options import EngineOptions
options = {name: tuple(v) if isinstance(v, list) else v for name, v in json.loads(sys.argv[2]).items()}
core = EngineCore(sys.argv[1], EngineOptions(device="cuda", **options))
core.close()
print(json.dumps({p.name: p.seconds for p in core.startup.phases}))
"""


# A small start: the first test's two starts take these options.
SMALL = {"kv_cache_tokens": 4096, "decode_buckets": [1, 2, 4, 8]}


def start(artifact: Path, triton_cache: Path, options: dict = SMALL) -> tuple[dict[str, float], list[str]]:
    """The phases of one start (``EngineOptions`` fields ``options``) on an empty Triton cache, and the
    cache keys Triton wrote during it."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(triton_cache)}
    done = subprocess.run([sys.executable, "-c", START, str(artifact), json.dumps(options)], env=env,
                          capture_output=True, text=True, check=True, timeout=600)
    # Triton makes an empty directory for every key it looks up; a compiled kernel fills one.
    written = sorted(p.name for p in triton_cache.iterdir() if any(p.iterdir())) if triton_cache.is_dir() else []
    return json.loads(done.stdout.strip().splitlines()[-1]), written


def test_a_second_start_compiles_no_triton_kernel(tmp_path):
    _, artifact = compile_random("smollm2-135m", 2, torch.bfloat16, tmp_path)
    first, compiled = start(artifact, tmp_path / "triton-first")
    assert compiled, "the first start compiles (or the test checks nothing)"
    shipped = list((artifact / "kernels").glob("triton-*"))
    assert len(shipped) == 1 and sorted(p.name for p in shipped[0].iterdir()) == compiled
    second, recompiled = start(artifact, tmp_path / "triton-second")
    print(f"kernel_warmup: first start {first['kernel_warmup']:.2f} s, second {second['kernel_warmup']:.2f} s; "
          f"graph_capture {first['graph_capture']:.2f} s, {second['graph_capture']:.2f} s")
    assert recompiled == []


def test_compile_warm_ships_the_kernels_for_this_gpu(tmp_path):
    from tests.e2e.test_cli import kiln

    model, _ = __import__("models").random_model("smollm2-135m", torch.bfloat16, 2)
    checkpoint, out = tmp_path / "hf", tmp_path / "m.kiln"
    model.save_pretrained(checkpoint)
    done = kiln("compile", str(checkpoint), "-o", str(out), "--max-seq-len", "256", "--warm")
    assert done.returncode == 0, done.stderr
    major, minor = torch.cuda.get_device_capability()
    shipped = out / "kernels" / f"triton-{__import__('triton').__version__}-sm_{major}{minor}"
    assert any(shipped.iterdir())
    # A start with the options --warm's start took (EngineOptions' defaults). Kernels specialize on
    # their buffers' sizes and alignment, which other decode buckets change: a start with other
    # options than the warming one's may compile a few more (measured: 15 of SmolLM2's decode kernels
    # with SMALL's buckets on an H100).
    _, recompiled = start(out, tmp_path / "triton-fresh", {})
    assert recompiled == []
