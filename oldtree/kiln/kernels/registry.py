"""The kernel registry: which function runs each op, chosen by backend, checker and priority.

``register_impl(op, backend, fn, checker, priority)`` adds an implementation. Selection walks the
implementations of the op for the wanted backend from the highest priority down and takes the
first whose checker accepts the node's types and attributes; the plain-torch reference matches
last, so every graph runs on the CPU.

Calling convention (what generated programs call): ``fn(*inputs, out=..., **attrs)`` writes into
``out`` (a tensor, or a tuple for several outputs) for ops that make fresh values; ops whose
outputs alias their inputs (views, in-place stores) take no ``out`` and return their outputs.
Implementations registered with ``wants_sizes=True`` also receive ``sizes``: the step's symbol
sizes and host-side facts such as ``max_q_len``. Those registered with ``wants_config=True`` read
tunables (block sizes, PDL) from a ``KernelConfig``, which the runtime binds to them once
(``KernelImpl.bound``) from the artifact's manifest. Those registered with ``reads_device=True`` copy
device values to the host mid-step (references that loop over sequences), so a step that runs one
cannot be captured as a CUDA graph.

Runtime ops are not IR ops: the sampler's ``argmax_rows``, ``apply_bitmask`` and ``sample_rows``,
which the runtime calls on a step's logits with the signature their torch reference has.
``impl_for_device`` picks their implementation: Triton's on a GPU, the reference elsewhere.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from kiln.ir.types import TensorType

from .config import KernelConfig

Checker = Callable[[Sequence[TensorType], Mapping[str, Any]], bool]
BACKENDS = ("torch", "triton")


def always(types: Sequence[TensorType], attrs: Mapping[str, Any]) -> bool:
    return True


@dataclass(frozen=True)
class KernelImpl:
    name: str
    op: str
    backend: str
    fn: Callable[..., Any]
    checker: Checker
    priority: int
    wants_sizes: bool
    reads_device: bool = False
    wants_config: bool = False

    def bound(self, config: KernelConfig) -> Callable[..., Any]:
        """The implementation as the runtime calls it: with ``config`` bound when it reads one."""
        return functools.partial(self.fn, config=config) if self.wants_config else self.fn


_IMPLS: dict[str, list[KernelImpl]] = {}
_BY_NAME: dict[str, KernelImpl] = {}


def register_impl(op: str, backend: str, fn: Callable[..., Any], checker: Checker = always, priority: int = 0,
                  name: str | None = None, wants_sizes: bool = False, reads_device: bool = False,
                  wants_config: bool = False) -> KernelImpl:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known: {BACKENDS}")
    impl = KernelImpl(name or f"{backend}.{op}", op, backend, fn, checker, priority, wants_sizes, reads_device,
                      wants_config)
    if impl.name in _BY_NAME:
        raise ValueError(f"kernel {impl.name!r} is registered twice")
    _IMPLS.setdefault(op, []).append(impl)
    _IMPLS[op].sort(key=lambda i: -i.priority)
    _BY_NAME[impl.name] = impl
    return impl


def select_impl(op: str, types: Sequence[TensorType], attrs: Mapping[str, Any], backend: str) -> KernelImpl:
    """The best implementation of ``op`` for ``backend``, falling back to the torch reference."""
    _load_families()
    candidates = _IMPLS.get(op, [])
    for wanted in (backend, "torch"):
        for impl in candidates:
            if impl.backend == wanted and impl.checker(types, attrs):
                return impl
    raise LookupError(f"no kernel implements op {op!r} for {[str(t) for t in types]} {dict(attrs)}")


def impl_for_device(op: str, device: torch.device) -> KernelImpl:
    """The implementation of a runtime op for tensors on ``device``: the best Triton one on a GPU, the
    torch reference elsewhere (also under TRITON_INTERPRET, where the sampler's kernels would
    interpret every program of a vocabulary-wide launch)."""
    return select_impl(op, (), {}, "triton" if device.type == "cuda" else "torch")


def get_impl(name: str) -> KernelImpl:
    _load_families()
    try:
        return _BY_NAME[name]
    except KeyError:
        raise LookupError(f"no kernel named {name!r}; known: {sorted(_BY_NAME)}") from None


def _load_families() -> None:
    from . import families  # noqa: F401  (registers every kernel family on import)
