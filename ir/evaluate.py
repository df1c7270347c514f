"""Compile-time evaluation of a node whose operands are all constants, with the
op's reference kernel. Shared by the constant-folding pass and by frontends
that must know shape-arithmetic values (ONNX `Shape -> Gather -> Concat -> Reshape`)."""

from __future__ import annotations

import torch

from npuc.errors import InternalError
from npuc.ir.graph import Graph, Node, TensorSource, Value
from npuc.ir.registry import get_op


def foldable(node: Node, max_bytes: int) -> bool:
    return (all(v.is_const for v in node.inputs)
            and sum(o.type.nbytes for o in node.outputs) <= max_bytes
            and all(v.type.nbytes <= max_bytes for v in node.inputs))


def fold_node(g: Graph, node: Node) -> list[Value]:
    """Evaluate `node`, replace its outputs by new constants everywhere, remove it."""
    with torch.no_grad():
        results = get_op(node.op).run([v.const.load() for v in node.inputs if v.const is not None], node.attrs)
    new = []
    for out, t in zip(node.outputs, results, strict=True):
        if tuple(t.shape) != out.type.shape or t.dtype != out.type.dtype.torch:
            raise InternalError(f"folding {node.name}: kernel returned {t.dtype}{list(t.shape)}, expected {out.type}")
        c = g.add_constant(out.name + "_folded", out.type, TensorSource(t.contiguous().clone(), "folded"))
        g.replace_all_uses_with(out, c)
        new.append(c)
    g.remove_node(node)
    return new
