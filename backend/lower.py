"""Lowering: an optimised `Graph` to the `.om` model definition.

The schedule is the graph's node order. Every non-constant value gets a tensor
descriptor in the arena region at the offset the memory planner chose; every
constant gets one in the weights region. Lifetimes: graph inputs are live from
step 0, node i's outputs from step i+1, and each value until its last use; graph
outputs live to the end so the caller can read them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from npuc.backend.memory_plan import Buffer, Plan, plan_memory, validate_plan
from npuc.backend.om_schema import AttrValue, ModelDef
from npuc.backend.targets import Target
from npuc.errors import InternalError
from npuc.ir import DType, Graph, Value, get_op


@dataclass
class Lowered:
    model: Any  # ModelDef message
    weights: list[Value]  # in weights-section order
    weight_offsets: list[int]
    weights_bytes: int
    plan: Plan


def _attr_value(v: Any) -> Any:
    if v is None:
        return AttrValue(none=True)
    if isinstance(v, bool):
        return AttrValue(b=v)
    if isinstance(v, DType):
        return AttrValue(dtype=v.value)
    if isinstance(v, int):
        return AttrValue(i=v)
    if isinstance(v, float):
        return AttrValue(f=v)
    if isinstance(v, str):
        return AttrValue(s=v)
    if isinstance(v, tuple) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        m = AttrValue()
        m.ints.values.extend(v)
        return m
    if isinstance(v, tuple):
        m = AttrValue()
        m.floats.values.extend(float(x) for x in v)
        return m
    raise InternalError(f"attribute value {v!r} has no .om encoding")


def lifetimes(g: Graph) -> dict[int, tuple[Value, int, int]]:
    """Value id -> (value, first step, last step) for everything that lives in the arena."""
    end = len(g.nodes) + 1
    live: dict[int, tuple[Value, int, int]] = {}
    for v in g.inputs:
        live[id(v)] = (v, 0, 0)
    for i, node in enumerate(g.nodes, start=1):
        for v in node.inputs:
            if id(v) in live:
                val, s, _ = live[id(v)]
                live[id(v)] = (val, s, i)
        for o in node.outputs:
            live[id(o)] = (o, i, i)
    for v in g.outputs:
        if id(v) in live:
            live[id(v)] = (v, live[id(v)][1], end)
    return live


def lower(g: Graph, target: Target, metadata: dict[str, str] | None = None) -> Lowered:
    import npuc

    model = ModelDef(producer="npuc", producer_version=npuc.__version__, target=target.name)
    index: dict[int, int] = {}

    # Weights: every constant, in graph order, each aligned.
    weights: list[Value] = []
    offsets: list[int] = []
    cursor = 0
    for c in g.constants.values():
        cursor = -(-cursor // target.weight_alignment) * target.weight_alignment
        index[id(c)] = len(model.tensors)
        model.tensors.add(name=c.name, dtype=c.type.dtype.value, shape=list(c.type.shape), region="weights",
                          offset=cursor, nbytes=c.type.nbytes, format=c.type.format)
        weights.append(c)
        offsets.append(cursor)
        cursor += c.type.nbytes
    weights_bytes = cursor

    live = lifetimes(g)
    buffers = []
    for vid, (v, s, e) in live.items():
        index[vid] = len(model.tensors)
        buffers.append(Buffer(index[vid], max(v.type.nbytes, 1), s, e))
        model.tensors.add(name=v.name, dtype=v.type.dtype.value, shape=list(v.type.shape), region="arena",
                          nbytes=v.type.nbytes, format=v.type.format)
    plan = plan_memory(buffers, target.alignment)
    validate_plan(buffers, plan)
    for b in buffers:
        model.tensors[b.id].offset = plan.offset(b.id)

    prog = model.programs.add(name=g.name)
    prog.inputs.extend(index[id(v)] for v in g.inputs)
    prog.outputs.extend(index[id(v)] for v in g.outputs)
    for node in g.nodes:
        od = get_op(node.op)
        op = prog.ops.add(op=node.op, name=node.name, unit=od.unit)
        op.inputs.extend(index[id(v)] for v in node.inputs)
        op.outputs.extend(index[id(v)] for v in node.outputs)
        for k in sorted(node.attrs):
            op.attrs.add(name=k, value=_attr_value(node.attrs[k]))
    pm = prog.plan
    pm.alignment = target.alignment
    pm.arena_bytes = plan.arena_bytes
    pm.lower_bound_bytes = plan.lower_bound
    for b in buffers:
        pm.buffers.add(tensor=b.id, first_step=b.start, last_step=b.end)
    model.weights_bytes = weights_bytes
    for k in sorted(metadata or {}):
        model.metadata.add(key=k, value=(metadata or {})[k])
    return Lowered(model, weights, offsets, weights_bytes, plan)


def _weight_bytes(v: Value) -> Iterator[bytes | memoryview]:
    """One constant's bytes. A source that can stream its raw bytes (an external data
    file) does, in bounded chunks; any other is loaded as one tensor and viewed, not copied."""
    src = v.const
    if src is None:
        raise InternalError(f"{v.ref()} is not a constant")
    raw = getattr(src, "raw_chunks", None)
    chunks = raw(v.type) if raw is not None else None
    if chunks is not None:
        yield from chunks
        return
    t = src.load()
    want = v.type
    if tuple(t.shape) != want.shape or t.dtype != want.dtype.torch:
        if t.numel() != want.numel:
            raise InternalError(f"weight {v.name} loads as {t.dtype}{list(t.shape)}, expected {want}")
        t = t.to(want.dtype.torch).reshape(want.shape)
    if t.numel():
        yield memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def weight_chunks(low: Lowered) -> Iterator[bytes | memoryview]:
    """Stream the weights section: each constant read from its source, one at a time."""
    cursor = 0
    for v, off in zip(low.weights, low.weight_offsets, strict=True):
        if off > cursor:
            yield b"\0" * (off - cursor)
        n = 0
        for chunk in _weight_bytes(v):
            n += len(chunk)
            yield chunk
        if n != v.type.nbytes:
            raise InternalError(f"weight {v.name} gave {n} bytes, expected {v.type.nbytes}")
        cursor = off + n
    if cursor != low.weights_bytes:
        raise InternalError("weights section size mismatch")
