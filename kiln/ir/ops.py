"""The op registry: every op is data, an ``OpDef`` with its inputs, attribute schema and type inference.

An op's type-inference function takes the input types and the attributes and returns the output
types, raising ``IRTypeError`` when the inputs do not fit. ``aliases`` says which outputs are not
new storage but views of (or in-place updates to) an input: the memory planner and the executor
rely on it. Op families live in ``ops_core`` (primitive ops the models use), ``ops_moe`` (the
mixture-of-experts ops), ``ops_fused`` (ops the fusion passes introduce) and ``ops_collective`` (the
ranks' exchanges the sharding passes introduce); each registers itself here on import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from .types import DType, TensorType
from .weights import QuantizedType

REQUIRED = object()

# Attribute kinds and the Python values they accept.
_ATTR_CHECKS: dict[str, Callable[[Any], bool]] = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "ints": lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in v),
    "dims": lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, (int, str)) and not isinstance(x, bool) for x in v),
    "dtype": lambda v: isinstance(v, str) and v in DType._value2member_map_,
}


class IRTypeError(ValueError):
    """An op's inputs or attributes do not fit its definition."""


@dataclass(frozen=True)
class AttrSpec:
    kind: str
    default: Any = REQUIRED

    def __post_init__(self) -> None:
        if self.kind not in _ATTR_CHECKS:
            raise ValueError(f"unknown attribute kind {self.kind!r}")


InferFn = Callable[[Sequence[TensorType], Mapping[str, Any]], tuple[TensorType, ...]]


@dataclass(frozen=True)
class OpDef:
    """One op: ``inputs`` names its operands (a trailing ``?`` marks an optional one, which may only
    be followed by other optional ones), ``attrs`` its attribute schema, ``infer`` its typing rule,
    ``aliases[i]`` the input index output ``i`` shares storage with (None: fresh storage).
    ``num_outputs=None`` lets the inference decide how many outputs there are (``split``); all of
    them then share the alias of the last ``aliases`` entry. ``reuses[i]`` names an input of output
    ``i``'s type whose storage the memory plan may give that output when this node is the input's
    last reader: every implementation must then allow ``out`` to be that input (each reads an
    element of it before writing the same element of ``out``). ``quantized`` names the inputs that
    may be quantized weights (``QuantizedType``); every other input must be a plain tensor."""

    name: str
    inputs: tuple[str, ...]
    attrs: Mapping[str, AttrSpec]
    infer: InferFn
    num_outputs: int | None = 1
    aliases: tuple[int | None, ...] = ()
    reuses: tuple[int | None, ...] = ()
    doc: str = ""
    # Ops with an effect (writes to an input) are never removed by dead-code elimination.
    has_effect: bool = False
    # Runs on the step's side stream, beside the main stream's next ops; the first op that reads one of
    # its outputs waits for it there (the program's ``streams.join()``), and the memory plan keeps
    # what it reads and writes until then.
    side_stream: bool = False
    quantized: tuple[str, ...] = ()

    def output_alias(self, index: int) -> int | None:
        if not self.aliases:
            return None
        if self.num_outputs is None:
            return self.aliases[min(index, len(self.aliases) - 1)]
        return self.aliases[index] if index < len(self.aliases) else None

    def output_reuse(self, index: int) -> int | None:
        return self.reuses[index] if index < len(self.reuses) else None

    @property
    def min_inputs(self) -> int:
        return sum(1 for name in self.inputs if not name.endswith("?"))

    def input_named(self, node_inputs: Sequence[str], name: str) -> str | None:
        """The value a node of this op passes as its input ``name`` (``node.inputs``; an optional input
        the node leaves out: None)."""
        index = [declared.rstrip("?") for declared in self.inputs].index(name)
        return node_inputs[index] if index < len(node_inputs) else None

    def normalize_attrs(self, attrs: Mapping[str, Any]) -> dict[str, Any]:
        """Checks ``attrs`` against the schema and fills in defaults (but a None default: then the
        attribute is left out); lists become tuples."""
        unknown = set(attrs) - set(self.attrs)
        if unknown:
            raise IRTypeError(f"{self.name}: unknown attribute(s) {sorted(unknown)}; expected {sorted(self.attrs)}")
        out: dict[str, Any] = {}
        for key, spec in self.attrs.items():
            if key in attrs:
                value = attrs[key]
            elif spec.default is REQUIRED:
                raise IRTypeError(f"{self.name}: attribute {key!r} is required")
            else:
                value = spec.default
            if value is None and spec.default is None:
                continue  # an optional attribute left unset is absent: not printed, not passed to kernels
            if value is not None and not _ATTR_CHECKS[spec.kind](value):
                raise IRTypeError(f"{self.name}: attribute {key}={value!r} is not of kind {spec.kind}")
            if isinstance(value, list):
                value = tuple(value)
            if spec.kind == "float" and isinstance(value, int):
                value = float(value)
            out[key] = value
        return out

    def infer_types(self, input_types: Sequence[TensorType], attrs: Mapping[str, Any]) -> tuple[TensorType, ...]:
        if not self.min_inputs <= len(input_types) <= len(self.inputs):
            raise IRTypeError(
                f"{self.name}: takes {self.min_inputs}..{len(self.inputs)} inputs ({', '.join(self.inputs)}), got {len(input_types)}"
            )
        for name, t in zip(self.inputs, input_types):
            if isinstance(t, QuantizedType) and name.rstrip("?") not in self.quantized:
                raise IRTypeError(f"{self.name}: {name} is a quantized weight ({t}, {t.format}); "
                                  f"only {', '.join(self.quantized) or 'plain tensors'} may be one here")
        result = self.infer(input_types, attrs)
        if self.num_outputs is not None and len(result) != self.num_outputs:
            raise IRTypeError(f"{self.name}: inferred {len(result)} outputs, expected {self.num_outputs}")
        return result


_REGISTRY: dict[str, OpDef] = {}


def register_op(op: OpDef) -> OpDef:
    if op.name in _REGISTRY:
        raise ValueError(f"op {op.name!r} is registered twice")
    _REGISTRY[op.name] = op
    return op


def get_op(name: str) -> OpDef:
    _load_families()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise IRTypeError(f"unknown op {name!r}") from None


def _load_families() -> None:
    # Imported lazily so the op families can import this module's helpers.
    from . import ops_collective, ops_core, ops_fused, ops_lora, ops_moe  # noqa: F401


# ---- helpers the op families share ----------------------------------------------------------

def expect(cond: bool, message: str) -> None:
    if not cond:
        raise IRTypeError(message)


def expect_rank(op: str, what: str, t: TensorType, rank: int) -> None:
    expect(t.rank == rank, f"{op}: {what} must have rank {rank}, got {t}")


def expect_int(op: str, what: str, t: TensorType) -> None:
    expect(t.dtype in (DType.i32, DType.i64), f"{op}: {what} must be an integer tensor, got {t}")


def expect_same(op: str, a: TensorType, b: TensorType) -> None:
    expect(a == b, f"{op}: operand types differ: {a} vs {b}")
