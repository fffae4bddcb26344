"""Compiles recorded Triton launches (``tests/support/triton_launches.py``) for a Hopper GPU (sm_90)
on a machine without one, down to PTX and the cubin.

Run as ``python -m tests.support.hopper_compile RECORDS.json LOG`` without ``TRITON_INTERPRET`` (so
``@triton.jit`` gives compiled kernels): it reads the JSON list of records and prints one JSON line per
record, ``{"ok": true}`` or ``{"ok": false, "error": ...}``, as each compiles (so a crash loses no
earlier result); the compiler's stderr while it compiles a record goes to LOG. Each launch is compiled
the way a launch on the GPU compiles it: ``kernel.warmup`` binds the arguments and specializes them
with Triton's own rules, against a stand-in driver whose current target is sm_90; stand-in tensors
carry the recorded dtype and alignment.

``compile_records`` runs the records in two such processes (the test machine's two cores).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
WORKERS = 2


class _Tensor:
    """A stand-in tensor: what Triton specializes a pointer argument on (dtype, 16-byte alignment)."""

    def __init__(self, dtype, aligned: bool) -> None:
        self.dtype = dtype
        self._ptr = 0 if aligned else 8

    def data_ptr(self) -> int:
        return self._ptr


class _HopperDriver:
    """Just enough of a driver for ``warmup``: the current device is an sm_90 GPU."""

    def __init__(self) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0


def _kernel(record: dict[str, Any]):
    """The compiled-mode kernel: from its module, or for a generated kernel from its file."""
    try:
        module = importlib.import_module(record["module"])
    except ModuleNotFoundError:
        spec = importlib.util.spec_from_file_location(record["module"], record["file"])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return getattr(module, record["kernel"])


def _argument(arg: dict[str, Any]):
    import torch

    if "tensor" in arg:
        return _Tensor(getattr(torch, arg["tensor"]), arg["aligned"])
    return arg["constexpr"] if "constexpr" in arg else arg["value"]


def compile_one(record: dict[str, Any]) -> None:
    kernel = _kernel(record)
    args = {name: _argument(arg) for name, arg in record["args"].items()}
    compiled = kernel.warmup(grid=(1,), **args, **record["options"])
    if not compiled.asm.get("cubin"):
        raise RuntimeError("compiled without a cubin")


def _diagnostics(log: Path) -> str:
    # Only MLIR's diagnostics: a failed pass also dumps the whole module there as a reproducer.
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return "\n".join(line for line in lines if ": error: " in line or ": note: " in line)[-3000:]


def _compile_reporting(record: dict[str, Any], log: Path) -> dict[str, Any]:
    """``compile_one``'s outcome, with the compiler's stderr in ``log`` meanwhile; a failure's message
    ends with its diagnostics (MLIR's, e.g. "operand does not dominate this use", go there, not into
    the exception)."""
    saved = os.dup(2)
    with open(log, "wb") as stderr:
        os.dup2(stderr.fileno(), 2)
    try:
        compile_one(record)
        return {"ok": True}
    except Exception as error:  # noqa: BLE001 - every failure is reported, named, to the test
        return {"ok": False, "error": "".join(traceback.format_exception_only(error))[-3000:] + _diagnostics(log)}
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def main() -> None:
    from triton.runtime.driver import driver

    driver.set_active(_HopperDriver())
    records, log = sys.argv[1:]
    for record in json.loads(Path(records).read_text()):
        print(json.dumps(_compile_reporting(record, Path(log))), flush=True)


def _start(records: list[dict[str, Any]], cache_dir: Path, worker: int) -> tuple[subprocess.Popen, Path]:
    """A worker compiling ``records``, and its compiler log."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(cache_dir / "triton"), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    path, log = cache_dir / f"records{worker}.json", cache_dir / f"stderr{worker}.log"
    path.write_text(json.dumps(records))
    process = subprocess.Popen([sys.executable, "-m", "tests.support.hopper_compile", str(path), str(log)], cwd=REPO,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return process, log


def compile_records(records: list[dict[str, Any]], cache_dir: Path, timeout: float = 600) -> list[dict[str, Any]]:
    """Each record's result, in order, compiled by ``WORKERS`` processes in a fresh ``cache_dir``.
    A worker that dies (a compiler crash, not an exception) fails the record it was on; the records
    after it are compiled by a new worker."""
    results: list[dict[str, Any] | None] = [None] * len(records)
    pending = [list(range(i, len(records), WORKERS)) for i in range(WORKERS)]
    while any(pending):
        running = [(indices, *_start([records[i] for i in indices], cache_dir, worker))
                   for worker, indices in enumerate(pending) if indices]
        pending = []
        for indices, process, log in running:
            out, err = process.communicate(timeout=timeout)
            lines = out.splitlines()
            for i, line in zip(indices, lines):
                results[i] = json.loads(line)
            if len(lines) < len(indices):
                results[indices[len(lines)]] = {"ok": False, "error": f"the compiler process died (exit "
                                                f"{process.returncode}): {err[-3000:]}{_diagnostics(log)}"}
                pending.append(indices[len(lines) + 1:])
    return results


if __name__ == "__main__":
    main()
