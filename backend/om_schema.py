"""The `.om` model definition: a protobuf schema, built in code so that npuc
needs no protoc at build time. `PROTO_TEXT` is the same schema as .proto text
(docs/om-format.md shows it; a test checks the two agree).

Writer and reader both use these classes; serialisation is deterministic.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "npuc.om.v1"

# (message, [(field, number, type, label, message type)])
_T = descriptor_pb2.FieldDescriptorProto
_OPT, _REP = _T.LABEL_OPTIONAL, _T.LABEL_REPEATED
_MESSAGES: list[tuple[str, list[tuple[str, int, int, int, str | None]]]] = [
    ("IntList", [("values", 1, _T.TYPE_INT64, _REP, None)]),
    ("FloatList", [("values", 1, _T.TYPE_DOUBLE, _REP, None)]),
    ("AttrValue", [
        ("i", 1, _T.TYPE_INT64, _OPT, None),
        ("f", 2, _T.TYPE_DOUBLE, _OPT, None),
        ("s", 3, _T.TYPE_STRING, _OPT, None),
        ("b", 4, _T.TYPE_BOOL, _OPT, None),
        ("dtype", 5, _T.TYPE_STRING, _OPT, None),
        ("ints", 6, _T.TYPE_MESSAGE, _OPT, "IntList"),
        ("floats", 7, _T.TYPE_MESSAGE, _OPT, "FloatList"),
        ("none", 8, _T.TYPE_BOOL, _OPT, None),
    ]),
    ("Attr", [("name", 1, _T.TYPE_STRING, _OPT, None), ("value", 2, _T.TYPE_MESSAGE, _OPT, "AttrValue")]),
    ("TensorDesc", [
        ("name", 1, _T.TYPE_STRING, _OPT, None),
        ("dtype", 2, _T.TYPE_STRING, _OPT, None),
        ("shape", 3, _T.TYPE_INT64, _REP, None),
        ("region", 4, _T.TYPE_STRING, _OPT, None),  # "arena" | "weights" | "state"
        ("offset", 5, _T.TYPE_UINT64, _OPT, None),
        ("nbytes", 6, _T.TYPE_UINT64, _OPT, None),
        ("format", 7, _T.TYPE_STRING, _OPT, None),
        ("base", 8, _T.TYPE_INT32, _OPT, None),  # a view or in-place result: the tensor whose buffer it shares
    ]),
    ("Op", [
        ("op", 1, _T.TYPE_STRING, _OPT, None),
        ("name", 2, _T.TYPE_STRING, _OPT, None),
        ("inputs", 3, _T.TYPE_INT32, _REP, None),
        ("outputs", 4, _T.TYPE_INT32, _REP, None),
        ("attrs", 5, _T.TYPE_MESSAGE, _REP, "Attr"),
        ("unit", 6, _T.TYPE_STRING, _OPT, None),  # stored in the tasks section
        ("flops", 7, _T.TYPE_UINT64, _OPT, None),  # stored in the tasks section
        ("bytes", 8, _T.TYPE_UINT64, _OPT, None),  # stored in the tasks section
        ("workspace", 9, _T.TYPE_INT32, _OPT, None),  # a u8 arena tensor live only during this op
    ]),
    ("Buffer", [
        ("tensor", 1, _T.TYPE_INT32, _OPT, None),
        ("first_step", 2, _T.TYPE_INT32, _OPT, None),
        ("last_step", 3, _T.TYPE_INT32, _OPT, None),
    ]),
    ("MemoryPlan", [
        ("alignment", 1, _T.TYPE_UINT64, _OPT, None),
        ("arena_bytes", 2, _T.TYPE_UINT64, _OPT, None),
        ("lower_bound_bytes", 3, _T.TYPE_UINT64, _OPT, None),
        ("buffers", 4, _T.TYPE_MESSAGE, _REP, "Buffer"),
        ("program", 5, _T.TYPE_STRING, _OPT, None),
    ]),
    ("Program", [
        ("name", 1, _T.TYPE_STRING, _OPT, None),
        ("inputs", 2, _T.TYPE_INT32, _REP, None),
        ("outputs", 3, _T.TYPE_INT32, _REP, None),
        ("ops", 4, _T.TYPE_MESSAGE, _REP, "Op"),
        ("plan", 5, _T.TYPE_MESSAGE, _OPT, "MemoryPlan"),  # stored in the plan section
    ]),
    ("MetaEntry", [("key", 1, _T.TYPE_STRING, _OPT, None), ("value", 2, _T.TYPE_STRING, _OPT, None)]),
    ("ModelDef", [
        ("producer", 1, _T.TYPE_STRING, _OPT, None),
        ("producer_version", 2, _T.TYPE_STRING, _OPT, None),
        ("target", 3, _T.TYPE_STRING, _OPT, None),
        ("tensors", 4, _T.TYPE_MESSAGE, _REP, "TensorDesc"),
        ("programs", 5, _T.TYPE_MESSAGE, _REP, "Program"),
        ("weights_bytes", 6, _T.TYPE_UINT64, _OPT, None),
        ("metadata", 7, _T.TYPE_MESSAGE, _REP, "MetaEntry"),  # stored in the metadata section
        ("state_bytes", 8, _T.TYPE_UINT64, _OPT, None),
    ]),
    # The sections besides `modeldef` (see backend/om_sections.py).
    ("Plans", [("plans", 1, _T.TYPE_MESSAGE, _REP, "MemoryPlan")]),
    ("Task", [
        ("op", 1, _T.TYPE_INT32, _OPT, None),
        ("unit", 2, _T.TYPE_STRING, _OPT, None),
        ("flops", 3, _T.TYPE_UINT64, _OPT, None),
        ("bytes", 4, _T.TYPE_UINT64, _OPT, None),
    ]),
    ("ProgramTasks", [("program", 1, _T.TYPE_STRING, _OPT, None), ("tasks", 2, _T.TYPE_MESSAGE, _REP, "Task")]),
    ("Tasks", [("programs", 1, _T.TYPE_MESSAGE, _REP, "ProgramTasks")]),
    ("Metadata", [("entries", 1, _T.TYPE_MESSAGE, _REP, "MetaEntry")]),
]


def _build() -> dict[str, Any]:
    fdp = descriptor_pb2.FileDescriptorProto(name="npuc_om_v1.proto", package=PACKAGE, syntax="proto3")
    for mname, fields in _MESSAGES:
        m = fdp.message_type.add(name=mname)
        for fname, num, ftype, label, mtype in fields:
            f = m.field.add(name=fname, number=num, type=ftype, label=label)
            if mtype:
                f.type_name = f".{PACKAGE}.{mtype}"
            if ftype == _T.TYPE_MESSAGE or label == _REP:
                continue
            # Explicit presence, so an attribute's kind is known from which field is set.
            f.proto3_optional = True
            f.oneof_index = len(m.oneof_decl)
            m.oneof_decl.add(name=f"_{fname}")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{name}"))
            for name, _ in _MESSAGES}


_CLASSES = _build()
ModelDef = _CLASSES["ModelDef"]
TensorDesc = _CLASSES["TensorDesc"]
Program = _CLASSES["Program"]
Op = _CLASSES["Op"]
AttrValue = _CLASSES["AttrValue"]
Plans = _CLASSES["Plans"]
Tasks = _CLASSES["Tasks"]
Metadata = _CLASSES["Metadata"]


def proto_text() -> str:
    """The schema as .proto source, for the format documentation."""
    names = {_T.TYPE_INT64: "int64", _T.TYPE_UINT64: "uint64", _T.TYPE_INT32: "int32", _T.TYPE_DOUBLE: "double",
             _T.TYPE_STRING: "string", _T.TYPE_BOOL: "bool"}
    lines = ['syntax = "proto3";', f"package {PACKAGE};", ""]
    for mname, fields in _MESSAGES:
        lines.append(f"message {mname} {{")
        for fname, num, ftype, label, mtype in fields:
            t = mtype if mtype else names[ftype]
            pre = "repeated " if label == _REP else ("" if mtype else "optional ")
            lines.append(f"  {pre}{t} {fname} = {num};")
        lines.append("}")
    return "\n".join(lines) + "\n"


# The prefix pool (--prefix_cache; backend/lower.py writes it, docs/om-format.md): metadata
# `prefix_pool` names each state cached by position and the axis of its positions,
# "kv_cache.0.k:2,kv_cache.0.v:2,..."; each has a pool tensor "prefix_pool.<state>" in the
# state region, [entries, *the state's shape[1:]], which no program uses.
PREFIX_POOL = "prefix_pool"

# A recurrent model's verify program keeps each recurrent state `<state>` after each of its rows
# but the last in a state "<state>.by_row", [slots, 1, K, n] (passes/recurrent_state.py names
# them: its BY_ROW is this; metadata `recurrent_rollback` lists them). What Session.rollback and
# `npuc info` look for without the compiler's modules.
ROLLBACK_SUFFIX = ".by_row"


def pool_tensor_name(state: str) -> str:
    return f"{PREFIX_POOL}.{state}"


def prefix_pool_value(states: list[tuple[str, int]]) -> str:
    return ",".join(f"{name}:{axis}" for name, axis in states)


def parse_prefix_pool(value: str) -> list[tuple[str, int]] | None:
    """(state, position axis) of each entry of metadata `prefix_pool`; None where it is not a
    list of distinct `name:axis` (axis one or two ASCII digits; the name up to the last colon)."""
    out = []
    for item in value.split(","):
        name, colon, axis = item.rpartition(":")
        if not name or not colon or not 1 <= len(axis) <= 2 or not all("0" <= c <= "9" for c in axis):
            return None
        out.append((name, int(axis)))
    return out if len({n for n, _ in out}) == len(out) else None
