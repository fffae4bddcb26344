"""JSON (de)serialization of graphs: the artifact stores the final graph this way beside graph.txt."""

from __future__ import annotations

import json
from typing import Any

from .graph import Graph, Param, make_node
from .types import TensorType
from .weights import Placement, WeightFormat


def graph_to_json(graph: Graph) -> dict[str, Any]:
    return {
        "name": graph.name,
        "inputs": [[name, str(t)] for name, t in graph.inputs.items()],
        "params": [{"name": p.name, "type": str(p.type), "format": p.format.to_json(),
                    "placement": p.placement.to_json()} for p in graph.params.values()],
        "nodes": [{"op": n.op, "inputs": list(n.inputs), "outputs": list(n.outputs),
                   "types": [str(t) for t in n.types],
                   "attrs": {k: list(v) if isinstance(v, tuple) else v for k, v in n.attrs.items()}}
                  for n in graph.nodes],
        "outputs": list(graph.outputs),
    }


def graph_from_json(data: dict[str, Any]) -> Graph:
    """Rebuilds a graph, re-inferring every node's types and checking them against the stored ones."""
    inputs = {name: TensorType.parse(t) for name, t in data["inputs"]}
    params = {p["name"]: Param(p["name"], TensorType.parse(p["type"]), WeightFormat.from_json(p["format"]),
                               Placement.from_json(p["placement"])) for p in data["params"]}
    types: dict[str, TensorType] = dict(inputs)
    types.update((name, p.value_type) for name, p in params.items())
    nodes = []
    for raw in data["nodes"]:
        node = make_node(raw["op"], raw["inputs"], raw["outputs"], [types[i] for i in raw["inputs"]], raw["attrs"])
        stored = tuple(TensorType.parse(t) for t in raw["types"])
        if stored != node.types:
            raise ValueError(f"{raw['op']} -> {raw['outputs']}: stored types differ from inferred ones")
        nodes.append(node)
        types.update(zip(node.outputs, node.types))
    return Graph(data["name"], inputs, params, tuple(nodes), tuple(data["outputs"]))


def dumps(graph: Graph) -> str:
    return json.dumps(graph_to_json(graph), indent=1)


def loads(text: str) -> Graph:
    return graph_from_json(json.loads(text))
