"""The IR: a `Graph` of `Node`s connected by `Value`s with explicit def-use.

A `Value` has exactly one producer (a node output, a graph input, or a graph
constant) and a list of uses `(node, operand index)`. Building a node registers
its uses; `replace_all_uses_with` is the core edit. Values compare by identity.

Constants (`@name` in the text form) carry a `ConstSource`: weights are read from
their file (safetensors, .pt2, ONNX external data) only when something asks for
the data, never copied into Python objects while the graph is rewritten.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

from npuc.errors import InternalError
from npuc.ir.types import TensorType

if TYPE_CHECKING:
    import torch


class ConstSource(Protocol):
    """Where a constant's bytes come from; `load` is called only when needed.

    `in_memory` (default False) says the data is already in memory, so passes may
    look at it; a weight in a file is read only to be written into the `.om`.
    A source may also offer `file_range(type) -> (path, offset, length) | None`: where
    its bytes lie in a file exactly as `type` lays them out (or None when they do not),
    so that the backend copies a large weight file to file, never through memory.
    """

    def load(self) -> torch.Tensor: ...

    def describe(self) -> str: ...


class TensorSource:
    """A constant computed by npuc itself (a folded subgraph, a buffer of the module)."""

    in_memory = True  # reading it costs nothing: passes may inspect its values

    def __init__(self, tensor: torch.Tensor, origin: str = "computed") -> None:
        self._tensor = tensor
        self._origin = origin

    def load(self) -> torch.Tensor:
        return self._tensor

    def describe(self) -> str:
        return self._origin


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes in C order as a flat uint8 tensor (copied only when its layout is
    not already dense: a broadcast constant has stride 0, even along a dim of size 1)."""
    import torch

    t = t.detach()
    if not t.numel():  # an empty tensor's strides may be anything, 0 included
        return torch.empty(0, dtype=torch.uint8)
    if not t.is_contiguous() or any(st == 0 for st in t.stride()):
        t = torch.empty(t.shape, dtype=t.dtype).copy_(t)
    flat = t.contiguous().reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:  # one element: "contiguous" whatever its stride
        flat = torch.empty(1, dtype=flat.dtype).copy_(flat)
    return flat.view(torch.uint8)


class MissingSource:
    """The source of a constant parsed from text: the text form carries no data."""

    def load(self) -> torch.Tensor:
        raise InternalError("constant parsed from textual IR has no data")

    def describe(self) -> str:
        return "none (parsed from text)"


_NAME_RE = re.compile(r"^[A-Za-z0-9_.]+$")
_IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")


def format_name(name: str, sigil: bool = True) -> str:
    """Bare when it is a plain name, else a JSON-quoted string. Without a sigil
    (the graph's own name) a bare name must also not start like a number."""
    if (_NAME_RE if sigil else _IDENT_RE).match(name):
        return name
    import json

    return json.dumps(name)


class Value:
    __slots__ = ("name", "type", "producer", "index", "uses", "const", "graph", "state")

    def __init__(self, name: str, type: TensorType, graph: Graph) -> None:
        self.name = name
        self.type = type
        self.producer: Node | None = None
        self.index = 0
        self.uses: list[tuple[Node, int]] = []
        self.const: ConstSource | None = None
        self.graph = graph
        self.state = False  # persistent across runs (the KV cache): read as an operand, written by an update

    @property
    def is_const(self) -> bool:
        return self.const is not None

    @property
    def is_input(self) -> bool:
        return self.producer is None and self.const is None and not self.state

    def users(self) -> list[Node]:
        seen: dict[int, Node] = {}
        for node, _ in self.uses:
            seen.setdefault(id(node), node)
        return list(seen.values())

    def ref(self) -> str:
        return ("@" if self.is_const else "%") + format_name(self.name)

    def __repr__(self) -> str:
        return f"<Value {self.ref()} : {self.type}>"


class Node:
    __slots__ = ("op", "inputs", "outputs", "attrs", "graph")

    def __init__(self, op: str, attrs: Mapping[str, Any], graph: Graph) -> None:
        self.op = op
        self.attrs: Mapping[str, Any] = MappingProxyType(dict(attrs))
        self.inputs: list[Value] = []
        self.outputs: list[Value] = []
        self.graph = graph

    @property
    def name(self) -> str:
        return self.outputs[0].name if self.outputs else f"<{self.op}>"

    @property
    def output(self) -> Value:
        if len(self.outputs) != 1:
            raise InternalError(f"{self.op} has {len(self.outputs)} outputs")
        return self.outputs[0]

    def set_attrs(self, **attrs: Any) -> None:
        """Change attributes in place; the result types must not change (the caller's to keep)."""
        self.attrs = MappingProxyType({**self.attrs, **attrs})

    def set_input(self, index: int, value: Value) -> None:
        old = self.inputs[index]
        old.uses.remove((self, index))
        self.inputs[index] = value
        value.uses.append((self, index))

    def __repr__(self) -> str:
        return f"<Node {self.name} = {self.op}>"


class Graph:
    """An ordered (topologically sorted) list of nodes plus inputs, constants and outputs.

    `states` are persistent tensors (the KV cache) that outlive one run and are shared
    by every program of a model; `state_updates` maps a state's name to the value it
    holds after the run. Updates are roots for liveness, like outputs."""

    def __init__(self, name: str = "main") -> None:
        self.name = name
        self.inputs: list[Value] = []
        self.outputs: list[Value] = []
        self.nodes: list[Node] = []
        self.constants: dict[str, Value] = {}
        self.states: dict[str, Value] = {}
        self.state_updates: dict[str, Value] = {}
        self._names: set[str] = set()
        self._live: set[int] = set()  # ids of the nodes in `nodes`, for O(1) membership
        self._counter = 0

    # -- naming ---------------------------------------------------------------
    def fresh_name(self, base: str) -> str:
        base = base or "v"
        if base not in self._names:
            return base
        while True:
            self._counter += 1
            cand = f"{base}_{self._counter}"
            if cand not in self._names:
                return cand

    def _new_value(self, name: str, type: TensorType) -> Value:
        if name in self._names:
            raise InternalError(f"duplicate value name {name!r}")
        self._names.add(name)
        return Value(name, type, self)

    # -- building -------------------------------------------------------------
    def add_input(self, name: str, type: TensorType) -> Value:
        v = self._new_value(name, type)
        self.inputs.append(v)
        return v

    def add_constant(self, name: str, type: TensorType, source: ConstSource) -> Value:
        v = self._new_value(self.fresh_name(name), type)
        v.const = source
        self.constants[v.name] = v
        return v

    def add_state(self, name: str, type: TensorType) -> Value:
        v = self._new_value(name, type)
        v.state = True
        self.states[name] = v
        return v

    def set_state_update(self, state: Value, value: Value) -> None:
        if not state.state or self.states.get(state.name) is not state or value.type != state.type:
            raise InternalError(f"{value.ref()} cannot update {state.ref()}")
        self.state_updates[state.name] = value

    def has_node(self, node: Node) -> bool:
        return id(node) in self._live and node.graph is self

    def root_ids(self) -> set[int]:
        """Ids of the values read after the run: graph outputs and states' new values."""
        return {id(v) for v in self.outputs} | {id(v) for v in self.state_updates.values()}

    def is_root(self, v: Value) -> bool:
        return id(v) in self.root_ids()

    def add_node(
        self,
        op: str,
        inputs: Sequence[Value],
        out_types: Sequence[TensorType],
        attrs: Mapping[str, Any] | None = None,
        names: Sequence[str] | str | None = None,
        before: Node | None = None,
    ) -> Node:
        node = Node(op, attrs or {}, self)
        for i, v in enumerate(inputs):
            if v.graph is not self:
                raise InternalError(f"value {v.ref()} belongs to another graph")
            node.inputs.append(v)
            v.uses.append((node, i))
        if isinstance(names, str):
            names = [names] if len(out_types) == 1 else [f"{names}_{i}" for i in range(len(out_types))]
        for i, t in enumerate(out_types):
            base = names[i] if names else op
            out = self._new_value(self.fresh_name(base), t)
            out.producer = node
            out.index = i
            node.outputs.append(out)
        self._live.add(id(node))
        if before is None:
            self.nodes.append(node)
        else:
            self.nodes.insert(self.nodes.index(before), node)
        return node

    def set_outputs(self, values: Iterable[Value]) -> None:
        self.outputs = list(values)

    # -- editing --------------------------------------------------------------
    def replace_all_uses_with(self, old: Value, new: Value) -> None:
        if old is new:
            return
        for node, i in list(old.uses):
            node.inputs[i] = new
            new.uses.append((node, i))
        old.uses.clear()
        self.outputs = [new if o is old else o for o in self.outputs]
        self.state_updates = {k: new if u is old else u for k, u in self.state_updates.items()}

    def remove_node(self, node: Node) -> None:
        for out in node.outputs:
            if out.uses or self.is_root(out):
                raise InternalError(f"removing {node.name} whose output {out.ref()} is still used")
        for i, v in enumerate(node.inputs):
            v.uses.remove((node, i))
        self.nodes.remove(node)
        self._live.discard(id(node))
        for out in node.outputs:
            self._names.discard(out.name)

    def remove_constant(self, value: Value) -> None:
        if value.uses or any(o is value for o in self.outputs):
            raise InternalError(f"removing constant {value.ref()} that is still used")
        del self.constants[value.name]
        self._names.discard(value.name)

    def rename(self, value: Value, name: str) -> None:
        """Give `value` a new, unique name (graph outputs get their user-facing names)."""
        if value.name == name:
            return
        if name in self._names:
            raise InternalError(f"duplicate value name {name!r}")
        self._names.discard(value.name)
        if value.is_const:
            del self.constants[value.name]
            self.constants[name] = value
        value.name = name
        self._names.add(name)

    # -- queries --------------------------------------------------------------
    def values(self) -> Iterator[Value]:
        yield from self.inputs
        yield from self.states.values()
        yield from self.constants.values()
        for n in self.nodes:
            yield from n.outputs

    def __str__(self) -> str:
        from npuc.ir.printer import print_graph

        return print_graph(self)

    def __eq__(self, other: object) -> bool:
        """Structural equality: the same text form (names, types, ops, attributes)."""
        if not isinstance(other, Graph):
            return NotImplemented
        return str(self) == str(other)

    __hash__ = None  # type: ignore[assignment]


def clone_graph(g: Graph) -> Graph:
    """A copy of `g` with the same names, types, ops and attributes, whose constants share
    their sources (nothing is loaded): one optimised graph specialised several ways (the
    ranks of a tensor-parallel compile) without building it again."""
    out = Graph(g.name)
    new: dict[int, Value] = {}
    for v in g.inputs:
        new[id(v)] = out.add_input(v.name, v.type)
    for name, v in g.states.items():
        new[id(v)] = out.add_state(name, v.type)
    for v in g.constants.values():
        assert v.const is not None
        c = out._new_value(v.name, v.type)
        c.const = v.const
        out.constants[c.name] = c
        new[id(v)] = c
    for n in g.nodes:
        m = out.add_node(n.op, [new[id(v)] for v in n.inputs], [o.type for o in n.outputs], n.attrs,
                         names=[o.name for o in n.outputs])
        for o, o2 in zip(n.outputs, m.outputs, strict=True):
            if o2.name != o.name:
                raise InternalError(f"cloning {g.name}: {o.name!r} came out as {o2.name!r}")
            new[id(o)] = o2
    out.outputs = [new[id(v)] for v in g.outputs]
    out.state_updates = {k: new[id(v)] for k, v in g.state_updates.items()}
    out._counter = g._counter
    return out


def distinct_outputs(g: Graph, outs: list[Value]) -> list[Value]:
    """Give every graph output its own producing node (an identity reshape where an
    output is an input, a constant, or another output), so each can carry its own name."""
    seen: set[int] = set()
    res = []
    for v in outs:
        if id(v) in seen or v.producer is None:
            v = g.add_node("reshape", [v], [v.type], {"shape": v.type.shape}, names="output").outputs[0]
        seen.add(id(v))
        res.append(v)
    return res
