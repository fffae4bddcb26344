"""Records the Triton launches of an interpreted run as launches of the GPU would be, for compiling them
ahead of time for Hopper (``tests/support/hopper_compile.py``).

Under ``TRITON_INTERPRET=1`` every ``kernel[grid](...)`` goes through ``InterpretedFunction.run``;
``record_launches`` wraps it and keeps, per launch, what Triton's compiler specializes on: the kernel,
each argument's kind (a tensor's dtype and 16-byte alignment, an int's value class, a constexpr's
value) and the compile options (``num_warps``, ``num_stages``, ...). Values that do not change the
compiled code (a sequence length of 7 or of 9) are reduced to one representative, so a run's thousands
of launches come down to the few distinct compilations the GPU would make.

The launchers choose some things differently under the interpreter than on a Hopper GPU; while
recording they are made to choose as on an H100 instead:
- ``triton_support.dot_in_f32``, whether matrix products take f32 copies of their operands: always
  when interpreted, on the GPU only for f32 activations. Replaced by the GPU's rule in every module that
  imported it, so constexprs derived from it follow (the interpreter's products of 16-bit operands are
  then wrong numbers, which no launch depends on);
- ``triton_support.multiprocessor_count``, which sizes split-K and split-KV grids and so some block
  constexprs: an H100's 132 SMs instead of the interpreter's 4;
- ``PDL``: kernels that await the previous one are launched with programmatic dependent launch on
  Hopper (``pdl_launch``, ``KernelConfig.pdl`` on by default), never when interpreted, since the
  interpreter cannot run ``gdc_wait``. Nothing is derived from it, so the record just says
  ``PDL=True`` and ``launch_pdl``.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import sys
from typing import Any, Iterator

import torch
import triton.language as tl
from triton.runtime.jit import _normalize_ty  # how Triton itself tells constexpr parameters

from kiln.kernels import triton_support

H100_SMS = 132  # an H100 SXM's streaming multiprocessors


def _gpu_dot_in_f32(dtype: torch.dtype) -> bool:
    return dtype == torch.float32


def _argument(value: Any) -> dict[str, Any]:
    """What Triton specializes a runtime argument on, with a representative value: a tensor's dtype
    and 16-byte alignment; an int's class (1, a multiple of 16, other) and width (i32 or i64)."""
    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch."), "aligned": value.data_ptr() % 16 == 0}
    if isinstance(value, bool) or value is None:
        return {"value": value}
    if isinstance(value, int):
        wide = not -2**31 <= value < 2**31
        if value == 1:
            return {"value": 1}
        return {"value": (2**32 if wide else 0) + (16 if value % 16 == 0 else 3)}
    if isinstance(value, float):
        return {"value": 0.5}  # float arguments are never specialized on their value
    raise TypeError(f"no record for a Triton argument of type {type(value).__name__}")


def _constexpr(value: Any) -> Any:
    if isinstance(value, tl.constexpr):  # a module-level named constant (``NORM = tl.constexpr(1)``)
        value = value.value
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    raise TypeError(f"no record for a constexpr of type {type(value).__name__}")


def launch_record(fn, args: tuple, kwargs: dict) -> dict[str, Any]:
    """One launch of the (interpreted) kernel ``fn`` as a JSON-able record of its compilation on Hopper."""
    signature = inspect.signature(fn)
    parameters = {name: value for name, value in kwargs.items() if name in signature.parameters}
    bound = signature.bind(*args, **parameters)
    bound.apply_defaults()
    record_args: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        if _normalize_ty(signature.parameters[name].annotation) == "constexpr":
            # PDL is what pdl_launch chooses on Hopper, with launch_pdl below (see the module docstring).
            record_args[name] = {"constexpr": True if name == "PDL" else _constexpr(value)}
        else:
            record_args[name] = _argument(value)
    options = {name: value for name, value in kwargs.items() if name not in signature.parameters}
    if "PDL" in record_args:
        options["launch_pdl"] = True
    return {"module": fn.__module__, "file": inspect.getsourcefile(fn), "kernel": fn.__qualname__,
            "args": record_args, "options": options}


def describe(record: dict[str, Any]) -> str:
    """The kernel, its constexprs and options, for a failure message."""
    constexprs = {name: arg["constexpr"] for name, arg in record["args"].items() if "constexpr" in arg}
    pointers = sorted({arg["tensor"] for arg in record["args"].values() if "tensor" in arg})
    return f"{record['module']}.{record['kernel']} {constexprs} {record['options']} pointers {pointers}"


class LaunchRecorder:
    """The distinct launches seen, in first-seen order."""

    def __init__(self) -> None:
        self.records: dict[str, dict[str, Any]] = {}

    def add(self, record: dict[str, Any]) -> None:
        self.records.setdefault(json.dumps(record, sort_keys=True), record)


@contextlib.contextmanager
def _replaced(name: str, value: Any) -> Iterator[None]:
    """``triton_support.<name>`` replaced by ``value``, there and in every module that imported it,
    before the block or during it (kernel modules are imported on first use, generated ones at load)."""
    original = getattr(triton_support, name)

    def swap(old: Any, new: Any) -> None:
        for module_name, module in list(sys.modules.items()):
            if module_name.startswith("kiln") and getattr(module, name, None) is old:
                setattr(module, name, new)

    swap(original, value)
    try:
        yield
    finally:
        swap(value, original)


@contextlib.contextmanager
def record_launches(recorder: LaunchRecorder, execute: bool = True) -> Iterator[None]:
    """Records every interpreted launch into ``recorder`` while the block runs, the launchers choosing
    as on an H100. With ``execute`` off the kernels are recorded but not run (for launches whose
    outputs nothing reads)."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        recorder.add(launch_record(self.fn, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs) if execute else None

    InterpretedFunction.run = recording_run
    try:
        with _replaced("dot_in_f32", _gpu_dot_in_f32), \
                _replaced("multiprocessor_count", lambda device_index: H100_SMS):
            yield
    finally:
        InterpretedFunction.run = run
