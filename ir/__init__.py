"""npuc's IR: graph, types, op registry, textual form and verifier."""

from npuc.ir.graph import ConstSource, Graph, MissingSource, Node, TensorSource, Value, distinct_outputs
from npuc.ir.parser import parse_graph
from npuc.ir.printer import print_graph
from npuc.ir.registry import REGISTRY, Attr, OpDef, all_ops, get_op
from npuc.ir.types import DType, TensorType
from npuc.ir.verifier import verify

__all__ = [
    "Attr", "ConstSource", "DType", "Graph", "MissingSource", "Node", "OpDef", "REGISTRY", "TensorSource",
    "TensorType", "Value", "all_ops", "distinct_outputs", "get_op", "parse_graph", "print_graph", "verify",
]
