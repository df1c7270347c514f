"""Checks on an untrusted `.onnx` file, before npuc converts or reads anything of it.

`check_model` runs right after `onnx.load(path, load_external_data=False)`:

- graph structure (NPUC-E0315): no value defined twice, every graph output produced,
  no cycle; nodes out of topological order are put in order. A node input that nothing
  defines is NPUC-E0312. Nodes of ai.onnx have the input and output counts and the
  attribute types their ONNX schema allows, so converters see well-formed nodes.
- initializers and tensor attributes (NPUC-E0316): dims non-negative, inline data
  exactly as long as the dims and element type say.
- external data (NPUC-E0317), checked once for every initializer before any file is
  read or hashed: a relative location with no `..`, resolving (symlinks followed)
  inside the model's folder, to a regular file (no directory, device or fifo), with a
  decimal offset and length whose range lies within that file.

Subgraphs (If, Loop, Scan bodies) are not checked: npuc converts no op that has one.
"""

from __future__ import annotations

import math
import os
import re
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from npuc.errors import EXIT_IO, EXIT_USAGE, InternalError, NpucError

# TensorProto.DataType -> bytes per element; 4-bit types pack two elements a byte.
_ITEMSIZE = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8, 14: 8, 15: 16, 16: 2,
             17: 1, 18: 1, 19: 1, 20: 1, 23: 1}
_PACKED4 = (21, 22, 23)  # UINT4, INT4, FLOAT4E2M1
# ai.onnx INT attributes that are flags: ONNX's shape inference reads 2 as "no", a converter's bool() as "yes".
_FLAGS = frozenset({"keepdims", "noop_with_empty_axes", "transA", "transB", "exclusive", "reverse", "upper",
                    "select_last_index", "detect_negative", "detect_positive", "largest", "sorted", "allowzero",
                    "is_causal", "interleaved"})
_DECIMAL = re.compile(r"[0-9]{1,19}")  # ASCII digits only: int() also takes "1_0", " 1", "+1", "١"


@dataclass(frozen=True)
class ExternalData:
    """Where a checked initializer's bytes lie: `path` (inside the model's folder), from `offset`."""

    path: str
    offset: int
    length: int | None  # as declared; None when the entry has no length


def _malformed(message: str) -> NpucError:
    return NpucError("NPUC-E0315", message, "the ONNX graph is malformed (run onnx.checker.check_model)",
                     exit_code=EXIT_IO)


def _bad_data(message: str) -> NpucError:
    return NpucError("NPUC-E0316", message, "the model file is corrupt or inconsistent; re-export it",
                     exit_code=EXIT_IO)


def _refused(message: str) -> NpucError:
    return NpucError("NPUC-E0317", message, "external data must be a regular file inside the model's folder, "
                     "named by a relative path, with its offset and length inside that file", exit_code=EXIT_IO)


def check_model(proto: Any, path: str) -> None:
    """Every check above, on `proto` as read from `path` (NpucError on the first failure)."""
    base = os.path.dirname(os.path.abspath(path))
    check_text(proto, "the model")
    check_graph(proto.graph, _opset(proto))
    for t in proto.graph.initializer:
        check_tensor(t, f"initializer {t.name!r}")
        if t.data_location == 1:
            external_data(t, base)
    for n in proto.graph.node:
        for t, what in _attribute_tensors(n):
            check_tensor(t, what)
            if t.data_location == 1:
                raise _refused(f"{what} keeps its data in an external file, which npuc reads for initializers only")


def check_text(msg: Any, where: str) -> None:
    """Every string field of `msg` and its sub-messages is UTF-8: protobuf hands an invalid
    one over as bytes, which no name, op type or path check expects. Bytes and number
    fields (a tensor's data) are not touched."""
    from google.protobuf.descriptor import FieldDescriptor

    for fd in msg.DESCRIPTOR.fields:
        repeated = fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == FieldDescriptor.LABEL_REPEATED
        if fd.type == FieldDescriptor.TYPE_STRING:
            for v in getattr(msg, fd.name) if repeated else (getattr(msg, fd.name),):
                if not isinstance(v, str):
                    raise _malformed(f"{where}: field {fd.name!r} holds {bytes(v)[:40]!r}, which is not UTF-8 text")
        elif fd.type == FieldDescriptor.TYPE_MESSAGE and (repeated or msg.HasField(fd.name)):
            for v in getattr(msg, fd.name) if repeated else (getattr(msg, fd.name),):
                check_text(v, where)


def _opset(proto: Any) -> int:
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)


# -- graph structure ------------------------------------------------------------------

def check_graph(graph: Any, opset: int) -> None:
    """Definitions, uses and order of `graph`'s values; sorts its nodes if they are out of order."""
    inits = {t.name for t in graph.initializer}
    defined: dict[str, str] = {}

    def define(name: str, by: str) -> None:
        if name in defined:
            raise _malformed(f"{name!r} is defined twice: by {defined[name]} and by {by}")
        defined[name] = by

    for t in graph.initializer:
        define(t.name, f"initializer {t.name!r}")
    for vi in graph.input:
        if vi.name not in inits:  # IR < 4 lists initializers as inputs too
            define(vi.name, f"graph input {vi.name!r}")
    producer: dict[str, int] = {}
    for k, n in enumerate(graph.node):
        for o in n.output:
            if o:
                define(o, f"{_where(n)}")
                producer[o] = k
    for n in graph.node:
        for i in n.input:
            if i and i not in defined:
                raise NpucError("NPUC-E0312", f"{_where(n)} reads {i!r}, which nothing defines",
                                "the ONNX graph is malformed (run onnx.checker)", exit_code=EXIT_USAGE)
        check_node(n, opset)
    for o in graph.output:
        if o.name not in defined:
            raise _malformed(f"graph output {o.name!r} is produced by nothing")
    order = _topological(graph.node, producer)
    if order != list(range(len(graph.node))):
        nodes = [graph.node[k] for k in order]
        copies = [type(n)() for n in nodes]
        for c, n in zip(copies, nodes, strict=True):
            c.CopyFrom(n)
        del graph.node[:]
        graph.node.extend(copies)


def _topological(nodes: Any, producer: dict[str, int]) -> list[int]:
    """Node indices in an order where each comes after its producers, keeping the file's order where it can."""
    import heapq

    deps = [{producer[i] for i in n.input if i in producer} for n in nodes]
    users: list[list[int]] = [[] for _ in deps]
    for k, d in enumerate(deps):
        for p in d:
            users[p].append(k)
    waiting = [len(d) for d in deps]
    ready = [k for k, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        k = heapq.heappop(ready)
        order.append(k)
        for u in users[k]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, u)
    if len(order) < len(deps):
        stuck = next(k for k, w in enumerate(waiting) if w)
        raise _malformed(f"the graph has a cycle through {_where(nodes[stuck])}")
    return order


def _where(n: Any) -> str:
    name = n.name or next((o for o in n.output if o), "")
    return f"{n.op_type or '?'} node {name!r}"


def check_node(n: Any, opset: int) -> None:
    """An ai.onnx node against its ONNX schema at `opset`: input, output and attribute counts and types.
    Nodes of other domains, or ops with no schema at this opset, are left to their converters."""
    import onnx

    seen: set[str] = set()
    for a in n.attribute:
        if a.name in seen:
            raise _malformed(f"{_where(n)} has attribute {a.name!r} twice")
        seen.add(a.name)
        for s in (a.s, *a.strings):
            try:
                s.decode()
            except UnicodeDecodeError:
                raise _malformed(f"{_where(n)}: attribute {a.name!r} is not UTF-8 text") from None
    if n.domain not in ("", "ai.onnx"):
        return
    try:
        schema = onnx.defs.get_schema(n.op_type, opset, "")
    except Exception:  # no such op at this opset: check_supported or the converter says so
        return
    if not schema.min_input <= len(n.input) <= schema.max_input:
        raise _malformed(f"{_where(n)} has {len(n.input)} inputs; {n.op_type}-{schema.since_version} takes "
                         f"{schema.min_input} to {schema.max_input}")
    if not schema.min_output <= len(n.output) <= schema.max_output:
        raise _malformed(f"{_where(n)} has {len(n.output)} outputs; {n.op_type}-{schema.since_version} gives "
                         f"{schema.min_output} to {schema.max_output}")
    single = onnx.defs.OpSchema.FormalParameterOption.Single
    for k, name in enumerate(n.input):
        param = schema.inputs[min(k, len(schema.inputs) - 1)]
        if not name and param.option == single:
            raise _malformed(f"{_where(n)} leaves its required input {param.name!r} empty")
    for k, name in enumerate(n.output):
        param = schema.outputs[min(k, len(schema.outputs) - 1)]
        if not name and param.option == single:
            raise _malformed(f"{_where(n)} leaves its required output {param.name!r} empty")
    for a in n.attribute:
        spec: Any = schema.attributes.get(a.name)  # onnx's stubs lack AttrType's int value
        if spec is None:
            raise _malformed(f"{_where(n)} has attribute {a.name!r}, which {n.op_type} does not take")
        if a.ref_attr_name:
            continue  # a function body's reference, resolved by inlining
        if int(a.type) != int(spec.type):
            names = onnx.AttributeProto.AttributeType.Name
            raise _malformed(f"{_where(n)}: attribute {a.name!r} is of type {names(a.type)}, {n.op_type} wants "
                             f"{names(int(spec.type))}")
        if a.name in _FLAGS and a.type == onnx.AttributeProto.INT and a.i not in (0, 1):
            raise _malformed(f"{_where(n)}: attribute {a.name!r} is {a.i}; it is a flag, 0 or 1")
    for name, spec in schema.attributes.items():
        if spec.required and name not in seen:
            raise _malformed(f"{_where(n)} lacks its required attribute {name!r}")


@contextmanager
def converting(where: str) -> Iterator[None]:
    """A converter's failure on operands or attribute values its node's schema allows but
    the op cannot take (a rank-2 `repeats`, an axis out of range, a zero step), as E0311.
    The schema check leaves such values to the converters; InternalError still escapes."""
    try:
        yield
    except InternalError:
        raise
    except (AssertionError, TypeError, ValueError, IndexError, KeyError, ZeroDivisionError, OverflowError,
            RuntimeError) as e:
        raise NpucError("NPUC-E0311", f"{where}: its operands or attributes do not fit "
                        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no detail'})",
                        "the ONNX node is inconsistent at the shapes given; check --input_shape, or run "
                        "onnx.checker.check_model(model, full_check=True)", exit_code=EXIT_USAGE) from None


def _attribute_tensors(n: Any) -> Iterable[tuple[Any, str]]:
    for a in n.attribute:
        if a.HasField("t"):
            yield a.t, f"attribute {a.name!r} of {_where(n)}"
        for t in a.tensors:
            yield t, f"attribute {a.name!r} of {_where(n)}"


# -- tensor data -----------------------------------------------------------------------

def tensor_nbytes(t: Any) -> int | None:
    """The bytes `t`'s dims and element type need as raw data, or None for a type npuc does not size."""
    numel = math.prod(int(d) for d in t.dims)
    if t.data_type in _PACKED4:
        return (numel + 1) // 2
    size = _ITEMSIZE.get(t.data_type)
    return None if size is None else numel * size


def check_tensor(t: Any, what: str) -> None:
    """Dims non-negative; inline data exactly as long as they say (E0316)."""
    import onnx

    if any(d < 0 for d in t.dims):
        raise _bad_data(f"{what} has a negative dim {list(t.dims)}")
    if t.HasField("segment"):
        raise _bad_data(f"{what} is stored in segments, which npuc does not read")
    nbytes = tensor_nbytes(t)
    if nbytes is None or t.data_location == 1:
        return  # an unsupported type is refused when converted; external data is checked by external_data
    if t.HasField("raw_data"):
        if len(t.raw_data) != nbytes:
            raise _bad_data(f"{what} has {len(t.raw_data)} bytes of raw data; dims {list(t.dims)} of "
                            f"{onnx.TensorProto.DataType.Name(t.data_type)} need {nbytes}")
        return
    numel = math.prod(int(d) for d in t.dims)
    want = (numel + 1) // 2 if t.data_type in _PACKED4 else numel
    field = onnx.helper.tensor_dtype_to_field(t.data_type)
    have = len(getattr(t, field))
    if t.data_type in (14, 15):  # complex: two values an element
        want *= 2
    if have != want:
        raise _bad_data(f"{what} has {have} values in {field}; dims {list(t.dims)} need {want}")


def _decimal(value: str, key: str, what: str) -> int:
    if not _DECIMAL.fullmatch(value):
        raise _refused(f"external data of {what}: {key} {value!r} is not a non-negative decimal integer")
    return int(value)


def external_data(t: Any, base: str) -> ExternalData:
    """`t`'s external data entry, checked against the model's folder `base` (E0317).

    The location is resolved with symlinks followed, and must stay inside `base`: onnx's
    own checker refuses the same paths (since 1.16)."""
    what = repr(t.name)
    ext: dict[str, str] = {}
    for e in t.external_data:
        if e.key in ext:
            raise _refused(f"external data of {what} has {e.key!r} twice")
        ext[e.key] = e.value
    loc = ext.get("location", "")
    if not loc or "\0" in loc:
        raise _refused(f"external data of {what} has no usable location")
    parts = re.split(r"[/\\]", loc)
    if os.path.isabs(loc) or loc.startswith(("/", "\\")) or ".." in parts:
        raise _refused(f"external data of {what} is at {loc!r}, which is not a relative path inside the "
                       "model's folder")
    offset = _decimal(ext.get("offset", "0"), "offset", what)
    length = _decimal(ext["length"], "length", what) if "length" in ext else None
    path = os.path.join(base, loc)
    real, root = os.path.realpath(path), os.path.realpath(base)
    if os.path.commonpath([real, root]) != root:
        raise _refused(f"external data of {what} is at {loc!r}, which leads out of the model's folder")
    try:
        st = os.stat(real)
    except OSError as e:
        raise _refused(f"external data of {what}: cannot open {loc!r} ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise _refused(f"external data of {what}: {loc!r} is not a regular file")
    nbytes = tensor_nbytes(t)
    if nbytes is not None and length is not None and length < nbytes:
        raise _bad_data(f"external data of {what} declares {length} bytes; dims {list(t.dims)} need {nbytes}")
    end = offset + max(length or 0, nbytes or 0)
    if end > st.st_size:
        raise _refused(f"external data of {what}: bytes {offset}..{end} lie past the end of {loc!r} "
                       f"({st.st_size} bytes)")
    return ExternalData(path, offset, length)
