"""Compile-time evaluation of a node whose operands are all constants, with the
op's reference kernel. Shared by the constant-folding pass and by frontends
that must know shape-arithmetic values (ONNX `Shape -> Gather -> Concat -> Reshape`)."""

from __future__ import annotations

import torch

from npuc.errors import InternalError
from npuc.ir.graph import ConstSource, Graph, Node, TensorSource, Value
from npuc.ir.registry import get_op
from npuc.ir.types import TensorType


def foldable(node: Node, max_bytes: int) -> bool:
    return (all(v.is_const for v in node.inputs)
            and sum(o.type.nbytes for o in node.outputs) <= max_bytes
            and all(v.type.nbytes <= max_bytes for v in node.inputs))


class LazyFoldSource:
    """A folded result whose operands include a weight in a file: computed when the
    backend writes it, so folding never reads weights while the graph is optimised."""

    in_memory = False

    def __init__(self, node: Node, index: int) -> None:
        self.op, self.attrs, self.index = node.op, dict(node.attrs), index
        self.sources = [v.const for v in node.inputs]
        self.type = node.outputs[index].type
        self.name = node.outputs[index].name

    def load(self) -> torch.Tensor:
        with torch.no_grad():
            t = get_op(self.op).run([s.load() for s in self.sources if s is not None], self.attrs)[self.index]
        return _checked(t, self.type, self.name)

    def describe(self) -> str:
        return f"{self.op} of " + ", ".join(s.describe() for s in self.sources if s is not None)


def _checked(t: torch.Tensor, want: TensorType, name: str) -> torch.Tensor:
    if tuple(t.shape) != want.shape or t.dtype != want.dtype.torch:
        raise InternalError(f"folding {name}: kernel returned {t.dtype}{list(t.shape)}, expected {want}")
    return t.contiguous()


def fold_node(g: Graph, node: Node) -> list[Value]:
    """Evaluate `node` (now, or lazily when an operand is a weight in a file), replace
    its outputs by new constants everywhere, remove it."""
    eager = all(getattr(v.const, "in_memory", False) for v in node.inputs)
    sources: list[ConstSource] = []
    if eager:
        with torch.no_grad():
            results = get_op(node.op).run([v.const.load() for v in node.inputs if v.const is not None], node.attrs)
        sources = [TensorSource(_checked(t, o.type, o.name).clone(), "folded")
                   for t, o in zip(results, node.outputs, strict=True)]
    else:
        sources = [LazyFoldSource(node, i) for i in range(len(node.outputs))]
    new = []
    for out, src in zip(node.outputs, sources, strict=True):
        c = g.add_constant(out.name + "_folded", out.type, src)
        g.replace_all_uses_with(out, c)
        new.append(c)
    g.remove_node(node)
    return new


def _cone(value: Value, feeds: dict[str, torch.Tensor]) -> set[int] | None:
    """The ids of the nodes `value` is computed by, from constants and the inputs in `feeds`;
    None if it reads another input (or a state)."""
    cone: set[int] = set()
    todo = [value]
    while todo:
        v = todo.pop()
        if v.is_const or v.name in feeds and v.producer is None:
            continue
        if v.producer is None:
            return None  # an input not fed, or a state: known at run time only
        if id(v.producer) not in cone:
            cone.add(id(v.producer))
            todo.extend(v.producer.inputs)
    return cone


def reads_inputs(value: Value) -> bool:
    """Whether `value` is computed from a graph input or a state (not from constants alone)."""
    return _cone(value, {}) is None


def evaluate_value(g: Graph, value: Value, feeds: dict[str, torch.Tensor] | None = None,
                   max_bytes: int = 1 << 28) -> torch.Tensor | None:
    """`value`'s tensor, computed with the ops' reference kernels from constants and the graph
    inputs named in `feeds`; None if it reads another input (or a state), or if the values
    computed on the way would pass `max_bytes`."""
    feeds = feeds or {}
    cone = _cone(value, feeds)
    if cone is None:
        return None
    nodes = [n for n in g.nodes if id(n) in cone]
    if sum(o.type.nbytes for n in nodes for o in n.outputs) > max_bytes:
        return None
    env: dict[int, torch.Tensor] = {id(v): feeds[v.name] for v in g.inputs if v.name in feeds}
    with torch.no_grad():
        for n in nodes:
            ins = [env[id(v)] if id(v) in env else _loaded(v) for v in n.inputs]
            for o, t in zip(n.outputs, get_op(n.op).run(ins, n.attrs), strict=True):
                env[id(o)] = t
    return env[id(value)] if id(value) in env else _loaded(value)


def _loaded(v: Value) -> torch.Tensor:
    if v.const is None:
        raise InternalError(f"{v.name} has no value to evaluate")
    return v.const.load()


def run_graph(g: Graph, feeds: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Run all of `g` with the reference kernels: (its outputs by name, its states' new values
    by name), from `feeds`, which names every input and every state. Ops that update a state in
    place (kv_write) update the fed tensor: pass copies to keep them. A value is dropped after
    its last use, so a run holds about what the runtime's arena would."""
    last: dict[int, int] = {}
    for i, n in enumerate(g.nodes):
        for v in n.inputs:
            last[id(v)] = i
    roots = g.root_ids()
    env: dict[int, torch.Tensor] = {}
    for v in [*g.inputs, *g.states.values()]:
        if v.name not in feeds:
            raise InternalError(f"run_graph: no value for {v.name}")
        env[id(v)] = feeds[v.name]
    with torch.no_grad():
        for i, n in enumerate(g.nodes):
            ins = [env[id(v)] if id(v) in env else _loaded(v) for v in n.inputs]
            for o, t in zip(n.outputs, get_op(n.op).run(ins, n.attrs), strict=True):
                env[id(o)] = t
            for v in n.inputs:
                if last.get(id(v)) == i and id(v) not in roots and v.producer is not None:
                    env.pop(id(v), None)

    def value(v: Value) -> torch.Tensor:
        return env[id(v)] if id(v) in env else _loaded(v)

    return ({v.name: value(v) for v in g.outputs},
            {name: value(v) for name, v in g.state_updates.items()})
