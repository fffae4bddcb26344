"""The verifier: checks a graph's invariants; the pipeline runs it between passes in tests.

Checked: every name is defined once; every input is defined before use; each node's attributes fit
its op's schema and its recorded types equal what the op infers; outputs exist; each parameter's
format fits its storage (a quantized weight's scales are plain parameters of the types its scheme
needs) and a shard's axis is within its rank.
"""

from __future__ import annotations

from .graph import Graph, Param
from .ops import IRTypeError, get_op


class VerifyError(ValueError):
    pass


def verify(graph: Graph) -> None:
    defined: dict[str, object] = {}
    for name, t in graph.inputs.items():
        defined[name] = t
    for name, p in graph.params.items():
        if name != p.name:
            raise VerifyError(f"param key {name!r} holds param named {p.name!r}")
        if name in defined:
            raise VerifyError(f"{name!r} is both an input and a param")
        _check_param(graph, p)
        defined[name] = p.value_type
    for index, node in enumerate(graph.nodes):
        where = f"node {index} ({node.op} -> {', '.join(node.outputs)})"
        for name in node.inputs:
            if name not in defined:
                raise VerifyError(f"{where}: reads {name!r} before it is defined")
        try:
            opdef = get_op(node.op)
            attrs = opdef.normalize_attrs(dict(node.attrs))
            inferred = opdef.infer_types([defined[i] for i in node.inputs], attrs)
        except IRTypeError as exc:
            raise VerifyError(f"{where}: {exc}") from None
        if attrs != dict(node.attrs):
            raise VerifyError(f"{where}: attributes {dict(node.attrs)} are not normalized ({attrs})")
        if tuple(inferred) != node.types:
            raise VerifyError(f"{where}: recorded types {[str(t) for t in node.types]} but op infers {[str(t) for t in inferred]}")
        if len(node.outputs) != len(node.types):
            raise VerifyError(f"{where}: {len(node.outputs)} names for {len(node.types)} outputs")
        for out, t in zip(node.outputs, node.types):
            if out in defined:
                raise VerifyError(f"{where}: redefines {out!r}")
            defined[out] = t
    if not graph.outputs:
        raise VerifyError("graph has no outputs")
    for out in graph.outputs:
        if out not in defined:
            raise VerifyError(f"graph output {out!r} is not defined")


def _check_param(graph: Graph, p: Param) -> None:
    where = f"param @{p.name}: {p.type}"
    if p.placement.axis is not None and p.placement.axis >= p.type.rank:
        raise VerifyError(f"{where}: placement {p.placement} shards axis {p.placement.axis}, beyond its rank {p.type.rank}")
    scheme = p.format.scheme
    if scheme is None:
        return
    try:
        needed = scheme.scale_types(p.type)
    except ValueError as exc:
        raise VerifyError(f"{where}: format {p.format}: {exc}") from None
    if len(p.format.scales) != len(needed):
        raise VerifyError(f"{where}: {scheme} needs {len(needed)} scale tensor(s), format names {len(p.format.scales)}")
    for name, t in zip(p.format.scales, needed):
        scale = graph.params.get(name)
        if scale is None:
            raise VerifyError(f"{where}: scale @{name} is not a param")
        if scale.type != t or scale.format.quantized:
            raise VerifyError(f"{where}: scale @{name} is {scale.type} {scale.format}, {scheme} needs plain {t}")
