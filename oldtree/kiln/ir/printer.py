"""The stable text form of a graph, and its parser: ``parse_graph(print_graph(g)) == g``.

    graph NAME {
      input %token_ids: i32[T]
      param @model.norm.weight: bf16[576]
      param @up: i8[1536, 576] format=int8_channel(@up.scale) placement=column(0)
      param @up.scale: f32[1536]
      %0 = embedding(%token_ids, @model.embed_tokens.weight) : bf16[T, 576]
      %1, %2 = add_rmsnorm(%0, %r, @w) {eps=1e-05, offset=0.0} : bf16[T, 576], bf16[T, 576]
      return %logits
    }

Pass tests compare graphs through this text, so it changes only on purpose.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .graph import Graph, Param, make_node
from .types import TensorType
from .weights import PLAIN, REPLICATED, Placement, WeightFormat

_NAME = r"[A-Za-z0-9_.\-]+"


def print_graph(graph: Graph) -> str:
    lines = [f"graph {graph.name} {{"]
    for name, t in graph.inputs.items():
        lines.append(f"  input %{name}: {t}")
    for p in graph.params.values():
        extra = ""
        if p.format != PLAIN:
            extra += f" format={p.format}"
        if p.placement != REPLICATED:
            extra += f" placement={p.placement}"
        lines.append(f"  param @{p.name}: {p.type}{extra}")
    for node in graph.nodes:
        outs = ", ".join(f"%{o}" for o in node.outputs)
        args = ", ".join(_ref(graph, i) for i in node.inputs)
        attrs = ""
        if node.attrs:
            attrs = " {" + ", ".join(f"{k}={_attr_text(v)}" for k, v in node.attrs.items()) + "}"
        types = ", ".join(str(t) for t in node.types)
        lines.append(f"  {outs} = {node.op}({args}){attrs} : {types}")
    lines.append("  return " + ", ".join(f"%{o}" for o in graph.outputs))
    lines.append("}")
    return "\n".join(lines) + "\n"


def _ref(graph: Graph, name: str) -> str:
    return f"@{name}" if name in graph.params else f"%{name}"


def _attr_text(value: Any) -> str:
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value)


def parse_graph(text: str) -> Graph:
    """Parses the printer's text back into a graph, re-inferring and checking every node's types."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    header = re.fullmatch(rf"graph ({_NAME}) \{{", lines[0]) if lines else None
    if not header or lines[-1] != "}":
        raise ValueError("graph text must start with 'graph NAME {' and end with '}'")
    inputs: dict[str, TensorType] = {}
    params: dict[str, Param] = {}
    nodes = []
    types: dict[str, TensorType] = {}
    outputs: tuple[str, ...] = ()
    for lineno, line in enumerate(lines[1:-1], start=2):
        try:
            if line.startswith("input "):
                m = re.fullmatch(rf"input %({_NAME}): (.+)", line)
                t = TensorType.parse(m.group(2))
                inputs[m.group(1)] = types[m.group(1)] = t
            elif line.startswith("param "):
                m = re.fullmatch(rf"param @({_NAME}): ([a-z0-9]+\[[^\]]*\])(?: format=(\w+\([^)]*\)))?"
                                 r"(?: placement=(\S+))?", line)
                param = Param(m.group(1), TensorType.parse(m.group(2)),
                              WeightFormat.parse(m.group(3)) if m.group(3) else PLAIN,
                              Placement.parse(m.group(4)) if m.group(4) else REPLICATED)
                params[param.name] = param
                types[param.name] = param.value_type
            elif line.startswith("return "):
                outputs = tuple(o.strip().lstrip("%") for o in line[len("return "):].split(","))
            else:
                node = _parse_node(line, types)
                nodes.append(node)
                types.update(zip(node.outputs, node.types))
        except Exception as exc:
            raise ValueError(f"line {lineno}: {line!r}: {exc}") from None
    return Graph(header.group(1), inputs, params, tuple(nodes), outputs)


def _parse_node(line: str, types: dict[str, TensorType]):
    m = re.fullmatch(r"(.+?) = (\w+)\((.*?)\)(?: \{(.*)\})? : (.+)", line)
    if not m:
        raise ValueError("not a node line")
    outs = [o.strip().lstrip("%") for o in m.group(1).split(",")]
    op = m.group(2)
    args = [a.strip()[1:] for a in m.group(3).split(",") if a.strip()]
    attrs = _parse_attrs(m.group(4) or "")
    node = make_node(op, args, outs, [types[a] for a in args], attrs)
    declared = tuple(TensorType.parse(t) for t in _split_top(m.group(5)))
    if declared != node.types:
        raise ValueError(f"declared types {[str(t) for t in declared]} differ from inferred {[str(t) for t in node.types]}")
    return node


def _parse_attrs(text: str) -> dict[str, Any]:
    attrs = {}
    for item in _split_top(text):
        key, value = item.split("=", 1)
        attrs[key.strip()] = json.loads(value)
    return attrs


def _split_top(text: str) -> list[str]:
    """Splits on commas outside brackets and quotes."""
    parts, depth, current, quoted = [], 0, [], False
    for ch in text:
        if ch == '"':
            quoted = not quoted
        elif not quoted and ch == "[":
            depth += 1
        elif not quoted and ch == "]":
            depth -= 1
        if ch == "," and depth == 0 and not quoted:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
    if "".join(current).strip():
        parts.append("".join(current).strip())
    return parts
