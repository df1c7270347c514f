"""Small helpers for building IR graphs by hand in tests."""

from __future__ import annotations

from typing import Any

import torch

from npuc.ir import DType, Graph, TensorSource, TensorType, Value, get_op


def f32(*shape: int) -> TensorType:
    return TensorType(shape, DType.f32)


def i64(*shape: int) -> TensorType:
    return TensorType(shape, DType.i64)


def node(g: Graph, op: str, inputs: list[Value], attrs: dict[str, Any] | None = None,
         name: str | None = None) -> Value:
    """Add `op` with the output type its shape rule infers; return its (only) output."""
    outs = get_op(op).infer_types([v.type for v in inputs], attrs or {})
    return g.add_node(op, inputs, outs, attrs, names=name).outputs[0]


def const(g: Graph, name: str, t: torch.Tensor) -> Value:
    return g.add_constant(name, TensorType(tuple(t.shape), DType.from_torch(t.dtype)), TensorSource(t))


def run_graph(g: Graph, feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Run `g` with each op's reference kernel; its outputs."""
    env = {id(v): feeds[v.name] for v in g.inputs}
    env.update({id(c): c.const.load() for c in g.constants.values() if c.const is not None})
    for n in g.nodes:
        for o, t in zip(n.outputs, get_op(n.op).run([env[id(v)] for v in n.inputs], n.attrs), strict=True):
            env[id(o)] = t
    return [env[id(v)] for v in g.outputs]
