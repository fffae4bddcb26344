"""kiln's graph IR: types, ops as data, graphs, a builder, a printer/parser, a verifier, JSON form."""

from .builder import GraphBuilder
from .graph import FrozenAttrs, Graph, Node, Param, make_node
from .ops import AttrSpec, IRTypeError, OpDef, get_op, register_op
from .printer import parse_graph, print_graph
from .types import Dim, DType, TensorType
from .verify import VerifyError, verify
from .weights import Layout, Placement, QuantizedType, WeightFormat

__all__ = [
    "AttrSpec", "Dim", "DType", "FrozenAttrs", "Graph", "GraphBuilder", "IRTypeError", "Layout", "Node", "OpDef",
    "Param", "Placement", "QuantizedType", "TensorType", "VerifyError", "WeightFormat", "get_op", "make_node",
    "parse_graph", "print_graph", "register_op", "verify",
]
