"""Lowering: optimised `Graph`s (one per program) to the `.om` model definition.

The schedule is each graph's node order. Regions:
- weights: every constant, once for all programs (shared by name when the same file
  tensor, folding or bytes), read-only and memory-mapped;
- state: the KV cache, once for all programs, persistent across runs; with
  `option.prefix_cache` P in the metadata (--prefix_cache), after it a pool of P prompt
  prefixes, each every cache's rows of one slot (`prefix_pool_states`);
- arena: each program's inputs, outputs and intermediates at the offsets the memory
  planner chose; programs never run at once, so the runtime allocates the largest.
A view (a reshape, or a transpose or slice that keeps the bytes in place: `is_view`) shares its operand's buffer and an in-place op (kv_write) its state's,
so one buffer's lifetime covers every value in it: from the step that defines the
first to the last use of any, or the end for graph outputs. An op whose out-kernel
needs scratch gets a workspace buffer live only at its own step.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

from npuc.backend.memory_plan import Buffer, Plan, align_up, plan_memory, validate_plan
from npuc.backend.om_format import FileRange
from npuc.backend.om_schema import PREFIX_POOL, AttrValue, ModelDef, pool_tensor_name, prefix_pool_value
from npuc.backend.targets import Target
from npuc.errors import EXIT_UNSUPPORTED, InternalError, NpucError
from npuc.ir import DType, Graph, Node, Value, get_op
from npuc.ir.evaluate import LazyFoldSource
from npuc.ir.graph import byte_view
from npuc.passes.recurrent_state import STATE_PREFIXES


@dataclass
class Lowered:
    model: Any  # ModelDef message
    weights: list[Value]  # in weights-section order
    weight_offsets: list[int]
    weights_bytes: int
    plans: list[Plan]  # one per program
    state_bytes: int = 0  # the prefix pool's included
    prefix_entries: int = 0  # --prefix_cache's pool: entries, and their bytes
    prefix_pool_bytes: int = 0
    # A weights section that begins with an image of one source file (`image_offsets`):
    # that file's range, and how many of `weights` (the first) lie in it.
    image: FileRange | None = None
    pinned: int = 0

    @property
    def plan(self) -> Plan:
        return self.plans[0]

    @property
    def arena_bytes(self) -> int:
        """The runtime allocates one arena, for the largest program."""
        return max(p.arena_bytes for p in self.plans)


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


def is_view(node: Node) -> bool:
    """Whether `node`'s output is its operand's bytes (or their prefix) under another
    shape, so that it can alias the operand's buffer: no copy, one lifetime for both.

        reshape                                   always
        transpose[perm=(0,2,1,3)] : [1,1,12,64]   when only size-1 axes move (decode's heads)
        slice[axis=1, 0:1] : [1,16,768]           a prefix: every axis before `axis` has size 1
                                                  (the rows kept after tile padding)
    """
    x = node.inputs[0].type.shape if node.inputs else ()
    if node.op == "reshape":
        return True
    if node.op == "transpose":
        moved = [p for p in node.attrs["perm"] if x[p] != 1]
        return moved == sorted(moved)
    if node.op == "slice":
        a = get_op("slice").full_attrs(node.attrs)
        ax = a["axis"] % len(x)
        kept = range(x[ax])[slice(a["start"], a["end"], a["step"])]
        return kept.step == 1 and (kept.start == 0 or not kept) and all(d == 1 for d in x[:ax])
    return False


def buffer_roots(g: Graph) -> dict[int, Value]:
    """Value id -> the value whose buffer it occupies: a view's base, an in-place op's
    operand, or itself."""
    root: dict[int, Value] = {}
    for v in (*g.inputs, *g.states.values()):
        root[id(v)] = v
    for node in g.nodes:
        od = get_op(node.op)
        # in place on a state, or on an earlier in-place result of one (a conv window written twice)
        inp = node.inputs[od.inplace] if od.inplace is not None else None
        src = inp if inp is not None and (inp.state or (id(inp) in root and root[id(inp)].state)) else None
        if src is None and node.inputs and not node.inputs[0].is_const and is_view(node):
            src = node.inputs[0]
        for o in node.outputs:
            root[id(o)] = root[id(src)] if src is not None and o.index == 0 else o
    return root


def lifetimes(g: Graph) -> dict[int, tuple[Value, int, int]]:
    """Buffer (root value) id -> (root, first step, last step) for everything in the arena.

    Graph inputs are live from step 0, node i's outputs from step i+1; a buffer lives
    until the last use of any value in it, and to the end if any is a graph output.
    States live in their own region and are not planned here."""
    end = len(g.nodes) + 1
    roots = buffer_roots(g)
    live: dict[int, tuple[Value, int, int]] = {}

    def touch(v: Value, step: int) -> None:
        r = roots.get(id(v))
        if r is None or r.state:
            return
        if id(r) not in live:
            live[id(r)] = (r, step, step)
        val, s, e = live[id(r)]
        live[id(r)] = (val, s, max(e, step))

    for v in g.inputs:
        touch(v, 0)
    for i, node in enumerate(g.nodes, start=1):
        for v in node.inputs:
            touch(v, i)
        for o in node.outputs:
            touch(o, i)
    for v in g.outputs:
        touch(v, end)
    return live


def _const_fingerprint(src: Any) -> Any:
    """What a constant is made of, to share a weight between programs: the same file
    tensor, the same folding of the same sources, or the same bytes."""
    if isinstance(src, LazyFoldSource):
        return ("fold", src.op, repr(sorted(src.attrs.items())), src.index,
                tuple(_const_fingerprint(s) for s in src.sources))
    if getattr(src, "in_memory", True):
        t = src.load().contiguous()
        return ("data", str(t.dtype), tuple(t.shape),
                hashlib.sha256(byte_view(t).numpy().tobytes()).hexdigest())
    return ("file", src.describe())


# The share of an image's bytes its weights must use, or the weights are laid out one by one.
IMAGE_MIN_USE = 0.9


def image_offsets(gs: Sequence[Graph], image: FileRange, alignment: int) -> dict[int, int]:
    """The constants (by id) stored as they are in `image`'s file at an `alignment`-aligned
    offset: placed at that offset of the weights section, which then begins with the whole
    file (backend/om_image.py copies it while the compile runs). Empty unless they hold at
    least IMAGE_MIN_USE of the file's bytes: the rest of the file is dead weight in the .om."""
    real = os.path.realpath(image.path)
    paths: dict[str, bool] = {}
    pinned: dict[int, int] = {}
    used: dict[int, int] = {}
    for g in gs:
        for c in g.constants.values():
            where = getattr(c.const, "file_range", None)
            stored = where(c.type) if where is not None else None
            if stored is None:
                continue
            path, offset, length = stored
            if path not in paths:
                paths[path] = os.path.realpath(path) == real
            if paths[path] and offset % alignment == 0 and offset + length <= image.length:
                pinned[id(c)] = offset
                used[offset] = max(used.get(offset, 0), length)
    cover, end = 0, 0
    for offset in sorted(used):  # the bytes the pinned ranges cover, overlaps once
        cover += max(0, offset + used[offset] - max(offset, end))
        end = max(end, offset + used[offset])
    return pinned if cover >= IMAGE_MIN_USE * image.length else {}


def lower(graphs: Graph | Sequence[Graph], target: Target, metadata: dict[str, str] | None = None,
          image: FileRange | None = None) -> Lowered:
    """One ModelDef for one or more programs (prefill and decode): weights and states
    are shared between them by name; each program has its own memory plan. With `image`
    (a whole source file) the weights section begins with that file where its weights
    use most of it (`image_offsets`; `Lowered.image` says whether they did)."""
    import npuc

    gs = [graphs] if isinstance(graphs, Graph) else list(graphs)
    model = ModelDef(producer="npuc", producer_version=npuc.__version__, target=target.name)

    # Weights: every constant of every program, once, each aligned; those in the image at
    # their place in it, the others after it.
    pin = image_offsets(gs, image, target.weight_alignment) if image is not None else {}
    if not pin:
        image = None
    weights: list[Value] = []
    offsets: list[int] = []
    by_name: dict[str, list[tuple[int, Any, Value]]] = {}
    names: set[str] = set()
    cursor = image.length if image is not None else 0
    index: list[dict[int, int]] = [{} for _ in gs]
    for pi, g in enumerate(gs):
        for c in g.constants.values():
            fp = _const_fingerprint(c.const) if len(gs) > 1 else None
            same = [t for t, f, v in by_name.get(c.name, []) if v.type == c.type and f == fp]
            if same:
                index[pi][id(c)] = same[0]
                continue
            name, n = c.name, 0
            while name in names:  # same name, other data: the later program's copy is renamed
                n += 1
                name = f"{g.name}.{c.name}" + (f".{n}" if n > 1 else "")
            names.add(name)
            if id(c) in pin:
                at = pin[id(c)]
            else:
                at = cursor = -(-cursor // target.weight_alignment) * target.weight_alignment
                cursor += c.type.nbytes
            index[pi][id(c)] = len(model.tensors)
            by_name.setdefault(c.name, []).append((len(model.tensors), fp, c))
            model.tensors.add(name=name, dtype=c.type.dtype.value, shape=list(c.type.shape), region="weights",
                              offset=at, nbytes=c.type.nbytes, format=c.type.format)
            weights.append(c)
            offsets.append(at)
    weights_bytes = cursor
    # In section order: the pinned (in the image, which comes first as one piece), then the rest.
    order = sorted(range(len(weights)), key=lambda i: (id(weights[i]) not in pin, offsets[i]))
    weights, offsets = [weights[i] for i in order], [offsets[i] for i in order]

    # States: one region, shared by every program.
    states: dict[str, tuple[int, Value]] = {}
    state_cursor = 0
    for pi, g in enumerate(gs):
        for st in g.states.values():
            if st.name in states:
                if states[st.name][1].type != st.type:
                    raise InternalError(f"state {st.name} is {st.type} in {g.name}, "
                                        f"{states[st.name][1].type} elsewhere")
            else:
                state_cursor = align_up(state_cursor, target.alignment)
                states[st.name] = (len(model.tensors), st)
                model.tensors.add(name=st.name, dtype=st.type.dtype.value, shape=list(st.type.shape), region="state",
                                  offset=state_cursor, nbytes=st.type.nbytes, format=st.type.format)
                state_cursor += st.type.nbytes
            index[pi][id(st)] = states[st.name][0]

    # The prefix pool: after the states, each positional state's rows of `entries` sequences.
    meta = dict(metadata or {})
    entries, pool_bytes = int(meta.get("option.prefix_cache") or 0), 0
    if entries:
        positional = prefix_pool_states(gs)
        for name, _ in positional:
            t = states[name][1].type
            state_cursor = align_up(state_cursor, target.alignment)
            nbytes = t.nbytes // t.shape[0] * entries
            model.tensors.add(name=pool_tensor_name(name), dtype=t.dtype.value, shape=[entries, *t.shape[1:]],
                              region="state", offset=state_cursor, nbytes=nbytes, format=t.format)
            state_cursor += nbytes
            pool_bytes += nbytes
        meta[PREFIX_POOL] = prefix_pool_value(positional)

    plans = []
    for pi, g in enumerate(gs):
        plans.append(_lower_program(model, g, index[pi], target))
    model.weights_bytes = weights_bytes
    model.state_bytes = state_cursor
    for k in sorted(meta):
        model.metadata.add(key=k, value=meta[k])
    return Lowered(model, weights, offsets, weights_bytes, plans, state_cursor, entries, pool_bytes,
                   image, sum(id(w) in pin for w in weights))


# The axis of its cache operand a cached write indexes by position (ir/fused_ops.py's kv_write:
# cache [slots, heads, positions, d]).
_POSITION_AXIS = {"kv_write": 2}


def prefix_pool_states(graphs: Sequence[Graph]) -> list[tuple[str, int]]:
    """(name, position axis) of every state of `graphs`, for a prefix pool (--prefix_cache): a
    KV, latent or conv cache, which its program's kv_write fills by position, so that positions
    0..n-1 of a slot are a prompt prefix of n tokens. A state kept per slot with no axis of
    positions (a recurrence's state, a conv window: passes/recurrent_state.py) holds the
    sequence up to its last token only, and cannot be restored at any other: refused
    (NPUC-E0123). Called by `lower` with option.prefix_cache in its metadata."""
    axes: dict[str, int] = {}
    for g in graphs:
        for name, st in g.states.items():
            users = st.users()
            axis = _POSITION_AXIS.get(users[0].op) if len(users) == 1 and st.uses[0][1] == 0 else None
            if name.startswith(STATE_PREFIXES) or axis is None:
                raise NpucError("NPUC-E0123", f"--prefix_cache: state {name} holds each slot's sequence as of its "
                                "last token, not a row per position: a prefix of it cannot be restored",
                                "compile without --prefix_cache (prefix reuse needs every state to cache by "
                                "position: attention and conv caches)", exit_code=EXIT_UNSUPPORTED)
            axes.setdefault(name, axis)
    if not axes:
        raise NpucError("NPUC-E0123", "--prefix_cache: the model caches nothing by position",
                        "compile it with --max_seq_len N, or without --prefix_cache", exit_code=EXIT_UNSUPPORTED)
    return list(axes.items())


def _lower_program(model: Any, g: Graph, index: dict[int, int], target: Target) -> Plan:
    roots = buffer_roots(g)
    for name, u in g.state_updates.items():  # written in place, so the update is the state's own buffer
        if roots.get(id(u)) is not g.states[name] or len(g.states[name].uses) != 1:
            raise InternalError(f"state {name} is not updated in place by its only reader")
    live = lifetimes(g)
    buffers = []
    for rid, (v, s, e) in live.items():
        index[rid] = len(model.tensors)
        buffers.append(Buffer(index[rid], max(v.type.nbytes, 1), s, e))
        model.tensors.add(name=v.name, dtype=v.type.dtype.value, shape=list(v.type.shape), region="arena",
                          nbytes=v.type.nbytes, format=v.type.format)
    # Scratch for out-kernels: planned like any buffer, live only at its op's step.
    workspaces: dict[int, int] = {}
    for step, node in enumerate(g.nodes, start=1):
        nbytes = get_op(node.op).workspace_bytes([v.type for v in node.inputs], [v.type for v in node.outputs],
                                                 node.attrs)
        if nbytes:
            workspaces[id(node)] = len(model.tensors)
            buffers.append(Buffer(len(model.tensors), nbytes, step, step))
            model.tensors.add(name=f"{node.name}.workspace", dtype=DType.u8.value, shape=[nbytes], region="arena",
                              nbytes=nbytes)
    plan = plan_memory(buffers, target.alignment)
    validate_plan(buffers, plan)
    for b in buffers:
        model.tensors[b.id].offset = plan.offset(b.id)
    # A view or in-place result: its own descriptor (name, shape) at its root's place.
    for v in g.values():
        r = roots.get(id(v))
        if r is None or r is v or id(v) in index:
            continue
        base = model.tensors[index[id(r)]]
        index[id(v)] = len(model.tensors)
        model.tensors.add(name=v.name, dtype=v.type.dtype.value, shape=list(v.type.shape), region=base.region,
                          offset=base.offset, nbytes=v.type.nbytes, format=v.type.format, base=index[id(r)])

    prog = model.programs.add(name=g.name)
    prog.inputs.extend(index[id(v)] for v in g.inputs)
    prog.outputs.extend(index[id(v)] for v in g.outputs)
    for node in g.nodes:
        od = get_op(node.op)
        ins, outs = [v.type for v in node.inputs], [v.type for v in node.outputs]
        op = prog.ops.add(op=node.op, name=node.name, unit=od.unit, flops=int(od.flops(ins, outs, node.attrs)),
                          bytes=od.bytes(ins, outs, node.attrs))
        op.inputs.extend(index[id(v)] for v in node.inputs)
        op.outputs.extend(index[id(v)] for v in node.outputs)
        if id(node) in workspaces:
            op.workspace = workspaces[id(node)]
        for k in sorted(node.attrs):
            op.attrs.add(name=k, value=_attr_value(node.attrs[k]))
    pm = prog.plan
    pm.alignment = target.alignment
    pm.arena_bytes = plan.arena_bytes
    pm.lower_bound_bytes = plan.lower_bound
    for b in buffers:
        pm.buffers.add(tensor=b.id, first_step=b.start, last_step=b.end)
    return plan


def _weight_bytes(v: Value) -> Iterator[bytes | memoryview | FileRange]:
    """One constant's bytes. A source that stores them as they are in a file (safetensors,
    ONNX external data) gives that byte range, for the writer to copy file to file; any
    other is loaded as one tensor and viewed, not copied."""
    src = v.const
    if src is None:
        raise InternalError(f"{v.ref()} is not a constant")
    where = getattr(src, "file_range", None)
    stored = where(v.type) if where is not None else None
    if stored is not None:
        path, offset, length = stored
        yield FileRange(path, offset, length, f"weight {v.name!r}")
        return
    t = src.load()
    want = v.type
    if tuple(t.shape) != want.shape or t.dtype != want.dtype.torch:
        if t.numel() != want.numel:
            raise InternalError(f"weight {v.name} loads as {t.dtype}{list(t.shape)}, expected {want}")
        t = t.to(want.dtype.torch).reshape(want.shape)
    if t.numel():
        yield memoryview(byte_view(t).numpy())


@overload
def weight_chunks(low: Lowered) -> Iterator[bytes | memoryview]: ...
@overload
def weight_chunks(low: Lowered, ranges: bool) -> Iterator[bytes | memoryview | FileRange]: ...
def weight_chunks(low: Lowered, ranges: bool = False) -> Iterator[bytes | memoryview | FileRange]:
    """Stream the weights section: each constant read from its source, one at a time. With
    `ranges`, a constant stored as it is in a file comes as its FileRange, unread."""
    cursor = 0
    if low.image is not None:  # the weights section begins with the image, which holds the pinned weights
        if ranges:
            yield low.image
        else:
            yield from low.image.chunks()
        cursor = low.image.length
    for v, off in zip(low.weights[low.pinned:], low.weight_offsets[low.pinned:], strict=True):
        if off > cursor:
            yield b"\0" * (off - cursor)
        n = 0
        for chunk in _weight_bytes(v):
            n += len(chunk)
            if isinstance(chunk, FileRange) and not ranges:
                yield from chunk.chunks()
            else:
                yield chunk
        if n != v.type.nbytes:
            raise InternalError(f"weight {v.name} gave {n} bytes, expected {v.type.nbytes}")
        cursor = off + n
    if cursor != low.weights_bytes:
        raise InternalError("weights section size mismatch")
