"""The one check of a `.om`'s model definition: `Session.load` runs it before anything
else, and `npuc validate` runs the same (plus every checksum, which `OmFile.open`
checks on both paths). A file that passes can be loaded and run; one that does not is
refused with a coded error, never a crash. Its cost is linear in the model definition,
never in the weights.

    structure   a program exists; every index names a tensor                 E0404/E0405
    tensors     known dtype and region; dims not negative; nbytes = the product
                of dims times the item size (Python ints: no overflow); offset
                aligned and inside its region                                E0404/E0405/E0410
    writes      no program input, program output, op output, in-place
                operand or workspace in the read-only weights                E0410
    ops         known (E0408); arity, attributes and attribute kinds against
                the registry schema; output types re-inferred by the op's
                shape rule and compared; workspace big enough                E0410
    memory      state bytes = the end of the last state tensor; every plan
                re-validated (lower bound and high-water mark recomputed,
                each tensor live where used); arena + state under the cap     E0409/E0410
    prefix pool metadata prefix_pool parses; each state it names has its pool
                tensor [entries, ...] of its layout, every other state is in
                it, and no program uses a pool tensor                         E0410/E0411
    metadata    values that the runtime parses (max_seq_len, eos_token_id,
                programs) parse and lie in range; a prefill + decode pair has
                a max_seq_len its cache and prefill fit; the tokenizer
                section is a JSON object of plain file names to base64       E0411

The memory cap is NPUC_MAX_MEMORY (bytes; suffixes K/M/G/T), else this machine's
physical memory: a file may not make the runtime allocate more than the host has.

The op checks need the op registry, which needs torch. Where torch cannot be imported (a
runtime-only install), `validate_model` checks everything else and says so
(`Checked.ops_checked` False): the C library's loader then checks each op against its
kernels' own shape rules (runtime/native_session.py), as every native load does.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import math
import os
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from npuc.backend.memory_plan import Buffer, Plan, validate_plan
from npuc.backend.om_schema import PREFIX_POOL, parse_prefix_pool, pool_tensor_name
from npuc.errors import EXIT_IO, InternalError, NpucError

if TYPE_CHECKING:
    from npuc.ir import OpDef

E_BOUNDS = "NPUC-E0404"
E_PARSE = "NPUC-E0405"
E_UNKNOWN_OP = "NPUC-E0408"
E_PLAN = "NPUC-E0409"
E_INVALID = "NPUC-E0410"
E_META = "NPUC-E0411"

REGIONS = ("arena", "weights", "state")
_HINT = "the file is damaged or was edited after compiling; recompile the model with `npuc compile`"
# dtype name -> bytes per element (ir/types.py's DType, without importing the registry)
ITEMSIZE = {"f64": 8, "f32": 4, "f16": 2, "bf16": 2, "i64": 8, "i32": 4, "i16": 2, "i8": 1, "u8": 1, "bool": 1}
_INT = re.compile(r"[0-9]{1,18}")
_MAX_DIM = 1 << 40  # an empty tensor's other dims are bounded too: shape rules multiply them  # ASCII decimal only (int() takes other scripts' digits too)


def bad(code: str, message: str) -> NpucError:
    return NpucError(code, message, _HINT, exit_code=EXIT_IO)


def attr_value(v: Any) -> Any:
    """A stored attribute as the registry's Python value (None for an unset one)."""
    which = [f.name for f, _ in v.ListFields()]
    if not which or which[0] == "none":
        return None
    k = which[0]
    if k == "dtype":
        if not registry_available():  # a listing without torch: the name as stored
            if v.dtype not in ITEMSIZE:
                raise ValueError(v.dtype)
            return v.dtype
        from npuc.ir import DType

        return DType(v.dtype)  # ValueError for an unknown one: the caller's refusal
    if k in ("ints", "floats"):
        return tuple(getattr(v, k).values)
    return getattr(v, k)


def memory_cap() -> int:
    """Bytes of arena + state a file may ask for (NPUC_MAX_MEMORY, else physical memory)."""
    text = os.environ.get("NPUC_MAX_MEMORY", "").strip().upper()
    if text:
        m = re.fullmatch(r"([0-9]+)([KMGT]?)B?", text)
        if m:
            return int(m.group(1)) << (10 * " KMGT".index(m.group(2) or " "))
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 1 << 40


@dataclass(frozen=True)
class PrefixPool:
    """The prefix pool of a valid definition (--prefix_cache): `entries` prefixes, each
    positions of every state in `states`: (state tensor, its pool tensor, the axis of its
    positions), tensor indices. `nbytes`: the pool tensors' bytes."""
    entries: int
    states: tuple[tuple[int, int, int], ...]
    nbytes: int


@dataclass(frozen=True)
class Checked:
    """What a valid definition adds up to."""
    arena_bytes: int
    state_bytes: int
    buffers: int
    ops_checked: bool = True  # against the registry's schemas (False: torch is not importable here)
    prefix: PrefixPool | None = None


@functools.cache
def registry_available() -> bool:
    """Whether the op registry (and so torch) can be imported in this process."""
    try:
        import npuc.ir  # noqa: F401
    except ImportError:
        return False
    return True


def validate_model(path: str, model: Any, weights: Any, tokenizer: bytes | None = None,
                   cap: int | None = None) -> Checked:
    """Check `model` (a parsed ModelDef) of the file at `path` whose weights section is
    `weights` (a buffer); raise a coded NpucError at the first problem."""
    weights_len = len(weights)
    check_structure(path, model)
    arena = max(int(p.plan.arena_bytes) for p in model.programs)
    dtypes = check_tensors(path, model, weights_len, arena)
    state_end = max((t.offset + t.nbytes for t in model.tensors if t.region == "state"), default=0)
    if model.state_bytes != state_end:
        raise bad(E_INVALID, f"{path}: the model declares {model.state_bytes} state bytes; its state tensors "
                             f"end at byte {state_end}")
    cap = memory_cap() if cap is None else cap
    if arena + model.state_bytes > cap:
        raise NpucError(E_INVALID, f"{path}: the model needs {arena + model.state_bytes} bytes of arena and "
                        f"state, more than the {cap} this runtime allows",
                        "set NPUC_MAX_MEMORY to allow more, if the file is trusted", exit_code=EXIT_IO)
    prefix = check_prefix_pool(path, model)
    buffers = 0
    names: set[str] = set()
    registry = registry_available()
    for prog in model.programs:
        if not prog.name or prog.name in names:
            raise bad(E_PARSE, f"{path}: program name {prog.name!r} is empty or repeated")
        names.add(prog.name)
        check_ops(path, model, prog, dtypes, registry)
        check_indices(path, model, prog, weights)
        buffers += check_plan(path, model, prog)
    meta = {e.key: e.value for e in model.metadata}
    check_metadata(path, meta, names)
    check_generation(path, model, meta)
    if tokenizer is not None:
        check_tokenizer(path, tokenizer)
    return Checked(arena, int(model.state_bytes), buffers, registry, prefix)


def check_structure(path: str, model: Any) -> None:
    """Everything else indexes freely once this passes: a program exists, every index is a tensor."""
    if not model.programs:
        raise bad(E_PARSE, f"{path}: the model definition has no program")
    n = len(model.tensors)
    for prog in model.programs:
        refs = [*prog.inputs, *prog.outputs, *(b.tensor for b in prog.plan.buffers)]
        for op in prog.ops:
            refs += [*op.inputs, *op.outputs, *([op.workspace] if op.HasField("workspace") else [])]
        wrong = [i for i in refs if not 0 <= i < n]
        if wrong:
            raise bad(E_BOUNDS, f"{path}: program {prog.name!r} refers to tensor {wrong[0]}, but there are {n}")


def _prefix_pool_meta(m: Any) -> str | None:
    return {e.key: e.value for e in m.metadata}.get(PREFIX_POOL)


def _first_states(m: Any) -> dict[str, int]:
    """Name -> index of the first state tensor of that name that is no view."""
    first: dict[str, int] = {}
    for i, t in enumerate(m.tensors):
        if t.region == "state" and not t.HasField("base"):
            first.setdefault(t.name, i)
    return first


def prefix_pool_tensors(m: Any) -> frozenset[int]:
    """The pool tensors metadata prefix_pool declares (none without a pool): state tensors
    that are no cache of the slots."""
    value = _prefix_pool_meta(m)
    items = parse_prefix_pool(value) if value is not None else None
    if not items:
        return frozenset()
    first = _first_states(m)
    return frozenset(first[n] for name, _ in items if (n := pool_tensor_name(name)) in first)


def prefix_pool_size(m: Any) -> tuple[int, int]:
    """(entries, bytes) of the prefix pool metadata prefix_pool declares: (0, 0) without one."""
    pools = [m.tensors[i] for i in sorted(prefix_pool_tensors(m))]
    return (int(pools[0].shape[0]) if pools and pools[0].shape else 0), sum(int(t.nbytes) for t in pools)


def check_prefix_pool(path: str, m: Any) -> PrefixPool | None:
    """The prefix pool (backend/lower.py): metadata prefix_pool's states, each with its pool
    tensor [entries, *its shape[1:]] of its dtype and positions on an axis after the slots';
    every other state in it (a load restores a sequence whole); no program, and no view, on
    a pool tensor (only the runtime's prefix copies touch it). None: the file has no pool."""
    value = _prefix_pool_meta(m)
    if value is None:
        return None
    items = parse_prefix_pool(value)
    if items is None:
        raise bad(E_META, f"{path}: metadata prefix_pool={value[:80]!r} is not a list of state:axis entries")
    if not any(e.key == "max_seq_len" for e in m.metadata):
        raise bad(E_META, f"{path}: metadata prefix_pool={value[:80]!r} comes without max_seq_len")
    first = _first_states(m)
    pool_names = {pool_tensor_name(name) for name, _ in items}
    states, entries, nbytes = [], 0, 0
    for name, axis in items:
        pool = pool_tensor_name(name)
        s, p = first.get(name), first.get(pool)
        if s is None or p is None or name in pool_names:
            raise bad(E_INVALID, f"{path}: metadata prefix_pool names state {name!r}, which has no state tensor "
                                 f"and pool tensor {pool!r}")
        st, pt = m.tensors[s], m.tensors[p]
        n = int(pt.shape[0]) if pt.shape else 0
        if not 1 <= axis < len(st.shape) or pt.dtype != st.dtype or len(pt.shape) != len(st.shape) \
                or list(pt.shape[1:]) != list(st.shape[1:]) or not 1 <= n < 1 << 31 or (entries and n != entries):
            raise bad(E_INVALID, f"{path}: prefix pool tensor {pool!r} is not [entries, ...] of state {name!r}'s "
                                 f"layout with positions on its axis {axis}")
        states.append((s, p, axis))
        entries, nbytes = n, nbytes + int(pt.nbytes)
    listed = {s for s, _, _ in states}
    pools = {p for _, p, _ in states}
    for i, t in enumerate(m.tensors):
        if t.region == "state" and not t.HasField("base") and i not in listed and i not in pools:
            raise bad(E_INVALID, f"{path}: state {t.name!r} is not in the prefix pool (metadata prefix_pool), so a "
                                 "prefix could not restore it")
        if t.HasField("base") and t.base in pools:
            raise bad(E_INVALID, f"{path}: tensor {t.name!r} shares the buffer of prefix pool tensor "
                                 f"{m.tensors[t.base].name!r}")
    for prog in m.programs:
        refs = [*prog.inputs, *prog.outputs]
        for op in prog.ops:
            refs += [*op.inputs, *op.outputs, *([op.workspace] if op.HasField("workspace") else [])]
        used = next((i for i in refs if i in pools), None)
        if used is not None:
            raise bad(E_INVALID, f"{path}: program {prog.name!r} uses prefix pool tensor {m.tensors[used].name!r}, "
                                 "which only the runtime's prefix copies may")
    return PrefixPool(entries, tuple(states), nbytes)


def check_tensors(path: str, m: Any, weights_len: int, arena_bytes: int) -> list[str]:
    """Each tensor's dtype, region, dims, size and place; returns the dtype names."""
    if m.weights_bytes != weights_len:
        raise bad(E_BOUNDS, f"{path}: the model definition says {m.weights_bytes} weight bytes, the "
                            f"'weights' section holds {weights_len}")
    limits = {"arena": arena_bytes, "weights": weights_len, "state": m.state_bytes}
    dtypes = []
    for t in m.tensors:
        if t.dtype not in ITEMSIZE:
            raise bad(E_PARSE, f"{path}: tensor {t.name!r} has unknown dtype {t.dtype!r}")
        itemsize = ITEMSIZE[t.dtype]
        dtypes.append(t.dtype)
        if t.region not in limits:
            raise bad(E_PARSE, f"{path}: tensor {t.name!r} is in unknown region {t.region!r}")
        if any(not 0 <= d <= _MAX_DIM for d in t.shape):  # 0 is a legal (empty) dim
            raise bad(E_INVALID, f"{path}: tensor {t.name!r} has shape {list(t.shape)}: dims must not be negative "
                                 f"(nor above {_MAX_DIM})")
        if math.prod(t.shape) * itemsize != t.nbytes:  # Python ints: a product never wraps
            raise bad(E_BOUNDS, f"{path}: tensor {t.name!r} is {t.dtype}{list(t.shape)} but says it has "
                                f"{t.nbytes} bytes")
        if t.offset % itemsize or t.offset + t.nbytes > limits[t.region]:
            raise bad(E_BOUNDS, f"{path}: tensor {t.name!r} (bytes {t.offset}..{t.offset + t.nbytes}) lies "
                                f"outside its {t.region} region of {limits[t.region]} bytes")
        if t.HasField("base"):
            b = m.tensors[t.base] if 0 <= t.base < len(m.tensors) else None
            if b is None or b.HasField("base") or b.region != t.region or b.offset != t.offset or t.nbytes > b.nbytes:
                raise bad(E_BOUNDS, f"{path}: tensor {t.name!r} says it shares tensor {t.base}'s buffer, "
                                    "which does not hold it")
    return dtypes


def op_def(path: str, op: Any) -> OpDef:
    from npuc.ir import get_op

    try:
        return get_op(op.op)
    except InternalError:
        raise NpucError(E_UNKNOWN_OP, f"{path}: op {op.name!r} is {op.op!r}, which this runtime does not know",
                        "update npuc to the version that compiled the model", exit_code=EXIT_IO) from None


def op_attrs(path: str, op: Any, od: OpDef) -> dict[str, Any]:
    """The op's attributes, checked against its schema, with defaults filled in."""
    try:
        attrs = {a.name: attr_value(a.value) for a in op.attrs}
    except ValueError as e:
        raise bad(E_INVALID, f"{path}: op {op.name!r} has an attribute that does not parse ({e})") from None
    if len(attrs) != len(op.attrs):
        raise bad(E_INVALID, f"{path}: op {op.name!r} repeats an attribute")
    problems = od.check_attrs(attrs)
    if problems:
        raise bad(E_INVALID, f"{path}: op {op.name!r} ({od.name}): {problems[0]}")
    return od.full_attrs(attrs)


def check_ops(path: str, m: Any, prog: Any, dtypes: list[str], registry: bool = True) -> None:
    """Each op against its registry schema (with `registry`), and nothing written in the
    read-only weights."""
    types: dict[int, Any] = {}

    def ttype(i: int) -> Any:
        from npuc.ir import DType, TensorType

        if i not in types:
            types[i] = TensorType(tuple(m.tensors[i].shape), DType(dtypes[i]))
        return types[i]

    def writable(i: int, why: str) -> None:
        if m.tensors[i].region == "weights":
            raise bad(E_INVALID, f"{path}: tensor {m.tensors[i].name!r} {why} in program {prog.name!r} but lies in "
                                 "the read-only weights")

    for kind, ids in (("input", prog.inputs), ("output", prog.outputs)):
        names = [m.tensors[i].name for i in ids]
        if len(set(names)) != len(names):  # run() feeds and returns them by name
            raise bad(E_INVALID, f"{path}: program {prog.name!r} has two {kind}s of one name: {names}")
    for i in prog.inputs:
        writable(i, "is an input")
        if m.tensors[i].region != "arena":
            raise bad(E_INVALID, f"{path}: input {m.tensors[i].name!r} of program {prog.name!r} is not in the arena")
    for i in prog.outputs:
        writable(i, "is an output")
    for op in prog.ops:
        if not registry:  # the writes only; the C loader checks the rest against its kernels
            for o in op.outputs:
                writable(o, f"is written by op {op.name!r}")
            if op.op in INPLACE and op.inputs:
                writable(op.inputs[INPLACE[op.op]], f"is updated in place by op {op.name!r}")
            continue
        od = op_def(path, op)
        attrs = op_attrs(path, op, od)
        if not od.arity_ok(len(op.inputs)):
            raise bad(E_INVALID, f"{path}: op {op.name!r} ({od.name}) has {len(op.inputs)} operands; it takes "
                                 f"{', '.join(od.inputs)}")
        ins = [ttype(i) for i in op.inputs]
        try:
            want = od.infer_types(ins, attrs)
        except Exception as e:  # noqa: BLE001 - a shape rule's refusal of what the file says, whatever its type
            raise bad(E_INVALID, f"{path}: op {op.name!r} ({od.name}) does not take its operands "
                                 f"{[str(t) for t in ins]}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                      ) from None
        got = [ttype(o) for o in op.outputs]
        if [(t.shape, t.dtype) for t in want] != [(t.shape, t.dtype) for t in got]:
            raise bad(E_INVALID, f"{path}: op {op.name!r} ({od.name}) declares outputs {[str(t) for t in got]}; "
                                 f"its operands make {[str(t) for t in want]}")
        for o in op.outputs:
            writable(o, f"is written by op {op.name!r}")
        if od.inplace is not None:
            writable(op.inputs[od.inplace], f"is updated in place by op {op.name!r}")
        need = od.workspace_bytes(ins, got, attrs) if od.workspace is not None else 0
        if op.HasField("workspace"):
            w = m.tensors[op.workspace]
            if w.region != "arena" or w.nbytes < need:
                raise bad(E_INVALID, f"{path}: op {op.name!r} has a workspace of {w.nbytes} bytes in {w.region}; "
                                     f"it needs {need} in the arena")
        elif need:
            raise bad(E_INVALID, f"{path}: op {op.name!r} ({od.name}) needs a workspace of {need} bytes and has none")


# The registry's in-place ops (OpDef.inplace), for the check without the registry; a test holds
# this to the registry.
INPLACE = {"kv_write": 0, "selective_scan_state": 0, "gated_delta_rule_state": 0, "wkv_state": 0,
           "linear_recurrence_state": 0, "linear_attention_state": 0}

# op -> (its index operand, the operand it indexes, that operand's axis): the rows a position
# or id may name. An index stored in the weights is read and checked here (a few KB at most);
# a `position` input is checked by the session against the KV cache's rows, so the tables
# it indexes must hold that many; an index computed at run time is checked by the kernel.
_INDEXES = {"rope_lut": (1, 2, 0), "kv_write": (2, 0, 2), "cached_attention": (3, 1, 2), "cached_conv1d": (2, 0, 2)}
_SMALL = 1 << 20


# passes/recurrent_state.py's states: a fixed size per slot, no rows per position
RECURRENT_STATES = ("ssm_state.", "delta_state.", "wkv_state.", "lru_state.", "linear_state.", "conv_window.")


def position_rows(m: Any) -> int:
    """The positions a `position` input may name: the KV cache's rows, and no more than the
    metadata's max_seq_len (the cache is rounded up to the tile; the RoPE tables, traced at
    max_seq_len, hold that many rows). 0: the model has no cache."""
    pools = prefix_pool_tensors(m)
    rows = min((int(t.shape[2]) for i, t in enumerate(m.tensors) if t.region == "state" and len(t.shape) == 4
                and not t.name.startswith(RECURRENT_STATES) and i not in pools), default=0)
    meta = next((e.value for e in m.metadata if e.key == "max_seq_len"), None)
    n = _ints(meta) if meta is not None else None
    return min(rows, n[0]) if rows and n is not None and len(n) == 1 and n[0] > 0 else rows


def check_indices(path: str, m: Any, prog: Any, weights: Any) -> None:
    rows = position_rows(m)
    cache = [rows] if rows else []
    inputs = {m.tensors[i].name: i for i in prog.inputs}
    for op in prog.ops:
        checks = [_INDEXES[op.op]] if op.op in _INDEXES else []
        table0 = m.tensors[op.inputs[0]] if op.inputs else None
        if op.op == "gather" and len(op.inputs) == 2 and table0 is not None and table0.shape:
            axis = next((a.value.i for a in op.attrs if a.name == "axis"), 0)
            checks = [(1, 0, axis % len(table0.shape))]
        elif op.op == "index" and table0 is not None:  # x[i0, i1, ...]: operand j indexes axis j - 1
            checks = [(j, 0, j - 1) for j in range(1, min(len(op.inputs), len(table0.shape) + 1))]
        for which in checks:
            if len(op.inputs) > max(which[:2]):
                _check_index(path, m, op, which, weights, inputs, cache)


def _check_index(path: str, m: Any, op: Any, which: tuple[int, int, int], weights: Any, inputs: Mapping[str, int],
                 cache: list[int]) -> None:
    idx, table = m.tensors[op.inputs[which[0]]], m.tensors[op.inputs[which[1]]]
    rows = int(table.shape[which[2]])
    low = -rows if op.op in ("gather", "index") else 0
    if idx.region == "weights" and idx.nbytes <= _SMALL and idx.dtype in ("i64", "i32"):
        import numpy as np  # here, not at the top: `npuc info` imports this module and needs no numpy

        vals = np.frombuffer(weights[idx.offset:idx.offset + idx.nbytes], dtype="<i8" if idx.dtype == "i64" else "<i4")
        if vals.size and not (low <= int(vals.min()) and int(vals.max()) < rows):
            raise bad(E_INVALID, f"{path}: op {op.name!r} ({op.op}) indexes {rows} rows of {table.name!r} with "
                                 f"{idx.name!r}, which holds {int(vals.min())}..{int(vals.max())}")
    elif inputs.get("position") == op.inputs[which[0]] and cache and rows < min(cache):
        raise bad(E_INVALID, f"{path}: op {op.name!r} ({op.op}) indexes {rows} rows of {table.name!r} by "
                             f"position, which runs to {min(cache)} (the KV cache's rows, up to max_seq_len)")


def check_plan(path: str, m: Any, prog: Any) -> int:
    """Re-validate one program's memory plan from the file; returns its buffer count."""
    def wrong(reason: str) -> NpucError:
        return NpucError(E_PLAN, f"the memory plan in {path} is invalid: {reason}",
                         "buffer ids are tensor indices (see `npuc dump --json`); " + _HINT, exit_code=EXIT_IO)

    pm = prog.plan
    if pm.alignment <= 0:
        raise wrong("its alignment is 0")
    seen: set[int] = set()
    for b in pm.buffers:
        if m.tensors[b.tensor].region != "arena":
            raise wrong(f"buffer {b.tensor} is tensor {m.tensors[b.tensor].name!r}, which is not in the arena")
        if b.tensor in seen:
            raise wrong(f"buffer {b.tensor} is listed twice")
        seen.add(b.tensor)
    # validate_plan also checks that arena_bytes is where the highest buffer ends
    # and is not below the lower bound, which it recomputes from the lifetimes.
    try:
        buffers = [Buffer(b.tensor, max(m.tensors[b.tensor].nbytes, 1), b.first_step, b.last_step)
                   for b in pm.buffers]
        plan = Plan(offsets=tuple(sorted((b.id, m.tensors[b.id].offset) for b in buffers)),
                    arena_bytes=pm.arena_bytes, lower_bound=pm.lower_bound_bytes, alignment=pm.alignment)
        validate_plan(buffers, plan)
    except InternalError as e:  # the planner's invariants, broken by the file rather than by npuc
        raise wrong(str(e)) from None

    # Each arena tensor must be live whenever it is touched: inputs from step 0,
    # op i (0-based) at step i+1, outputs until the copy-out after the last op.
    live = {b.id: b for b in buffers}
    last = len(prog.ops) + 1
    uses = [(i, 0, "is a program input") for i in prog.inputs]
    uses += [(i, last, "is a program output") for i in prog.outputs]
    for step, op in enumerate(prog.ops, start=1):
        uses += [(i, step, f"is used by op {op.name!r}") for i in [*op.inputs, *op.outputs]]
        if op.HasField("workspace"):
            uses.append((op.workspace, step, f"is the workspace of op {op.name!r}"))
    for tid, step, why in uses:
        t = m.tensors[tid]
        if t.region != "arena":
            continue
        b = live.get(t.base if t.HasField("base") else tid)
        if b is None:
            raise wrong(f"tensor {t.name!r} {why} but has no buffer")
        if not b.start <= step <= b.end:
            raise wrong(f"tensor {t.name!r} {why} at step {step} but its buffer {tid} is live only over "
                        f"steps {b.start}..{b.end}")
    return len(buffers)


def _ints(text: str) -> list[int] | None:
    items = text.split(",") if text else []
    return [int(i) for i in items] if all(_INT.fullmatch(i) for i in items) else None


def check_metadata(path: str, meta: Mapping[str, str], programs: Collection[str]) -> None:
    """The values the runtime reads from the metadata section."""
    def wrong(key: str, why: str) -> NpucError:
        return bad(E_META, f"{path}: metadata {key}={meta[key][:80]!r} {why}")

    if "max_seq_len" in meta:
        v = _ints(meta["max_seq_len"])
        if v is None or len(v) != 1 or not 1 <= v[0] < 1 << 31:
            raise wrong("max_seq_len", "is not a positive integer")
    if "eos_token_id" in meta and _ints(meta["eos_token_id"]) is None:
        raise wrong("eos_token_id", "is not a list of token ids")
    for key, top in (("parallel.world", 4096), ("parallel.rank", 4095), ("parallel.ep", 4096),
                     ("parallel.replicated_bytes", 1 << 62)):
        if key in meta:
            v = _ints(meta[key])
            if v is None or len(v) != 1 or not 0 <= v[0] <= top:
                raise wrong(key, "is not a rank count or index")
    if "parallel.rank" in meta and int(meta["parallel.rank"]) >= int(meta.get("parallel.world", "1")):
        raise wrong("parallel.rank", "is not below parallel.world")
    if "programs" in meta and set(meta["programs"].split(",")) - set(programs):
        raise wrong("programs", f"names a program the model does not have (it has {', '.join(programs)})")


def check_generation(path: str, m: Any, meta: Mapping[str, str]) -> None:
    """A model that says it generates (a prefill + decode pair and max_seq_len, what
    `generate` runs) has the programs `generate` feeds, and a cache and prefill that fit
    max_seq_len. (Without max_seq_len the programs still run; `generate` refuses them.)"""
    progs = {p.name: p for p in m.programs}
    if "prefill" not in progs or "decode" not in progs or "max_seq_len" not in meta:
        return
    n = int(meta["max_seq_len"])
    # the KV and conv caches' rows (a recurrent state has no rows per position)
    pools = prefix_pool_tensors(m)  # the caches of the slots, not the prefix pool's entries
    rows = [t.shape[2] for i, t in enumerate(m.tensors) if t.region == "state" and len(t.shape) == 4
            and not t.name.startswith(RECURRENT_STATES) and i not in pools]
    if rows and n > min(rows):
        raise bad(E_META, f"{path}: metadata max_seq_len={n} is longer than the KV cache's {min(rows)} rows")
    ids = [m.tensors[i] for i in progs["prefill"].inputs if m.tensors[i].name not in ("last_token", "slot")]
    if not ids or len(ids[0].shape) != 2 or ids[0].shape[1] > n:
        raise bad(E_META, f"{path}: the prefill program's token input does not fit max_seq_len={n}")
    # What generate reads: logits from both, and a decode step of (the same ids, a position).
    decode = [m.tensors[i] for i in progs["decode"].inputs]
    for name in ("prefill", "decode"):
        if "logits" not in {m.tensors[i].name for i in progs[name].outputs}:
            raise bad(E_INVALID, f"{path}: the {name} program has no 'logits' output")
    if len(decode) != 2 or ids[0].name not in {t.name for t in decode} or len({t.name for t in decode}) != 2 \
            or len(ids) != 1:
        raise bad(E_INVALID, f"{path}: the decode program's inputs {[t.name for t in decode]} are not the "
                             f"prefill's {ids[0].name!r} and a position")
    # Slots: prefill fills one sequence (its `slot` input), decode runs one token of each, at
    # each one's position; the cache holds that many.
    # Decode: C tokens (1, or --decode_tokens) of every slot, at positions [slots] (C = 1) or [slots, C].
    slot = [m.tensors[i] for i in progs["prefill"].inputs if m.tensors[i].name == "slot"]
    step = {t.name: t for t in decode}
    shape = list(step[ids[0].name].shape)
    slots, c = (int(shape[0]), int(shape[1])) if len(shape) == 2 else (0, 0)
    position = next(t for name, t in step.items() if name != ids[0].name)
    caches = {int(t.shape[0]) for i, t in enumerate(m.tensors) if t.region == "state" and len(t.shape) == 4
              and i not in pools}
    want = [slots] if c == 1 else [slots, c]
    if slot and (list(slot[0].shape) != [1] or ids[0].shape[0] != 1 or slots < 2 or caches != {slots}
                 or list(position.shape) != want):
        raise bad(E_INVALID, f"{path}: a prefill into a slot takes one sequence and slot [1], and decode the "
                             f"tokens of each of the cache's slots at their positions {want}")
    if not slot and list(position.shape) != ([1] if c == 1 else [1, c]):
        raise bad(E_INVALID, f"{path}: the decode program's position is {list(position.shape)}, not "
                             f"{[1] if c == 1 else [1, c]} (a model of one slot)")
    # Every token the logits can choose must be one the embedding takes back in.
    for prog in (progs["prefill"], progs["decode"]):
        ids_id = next(i for i in prog.inputs if m.tensors[i].name == ids[0].name)
        logits = next(m.tensors[i] for i in prog.outputs if m.tensors[i].name == "logits")
        for op in prog.ops:
            if op.op == "gather" and len(op.inputs) == 2 and op.inputs[1] == ids_id:
                table = m.tensors[op.inputs[0]]
                axis = next((a.value.i for a in op.attrs if a.name == "axis"), 0)
                vocab = int(table.shape[axis % len(table.shape)]) if table.shape else 0
                if not logits.shape or vocab < logits.shape[-1]:
                    raise bad(E_INVALID, f"{path}: the {prog.name} program's logits choose among "
                                         f"{logits.shape[-1] if logits.shape else 0} tokens; its embedding "
                                         f"{table.name!r} has {vocab} rows")


def check_tokenizer(path: str, data: bytes) -> dict[str, bytes]:
    """The stored tokenizer: a JSON object of plain file names to base64; returns the files."""
    try:
        files = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise bad(E_META, f"{path}: the tokenizer section is not JSON") from None
    if not isinstance(files, dict):
        raise bad(E_META, f"{path}: the tokenizer section is not a JSON object of files")
    out: dict[str, bytes] = {}
    for name, text in files.items():
        if not name or os.path.basename(name) != name or name.startswith(".") or "\0" in name:
            raise bad(E_META, f"{path}: the stored tokenizer names a file {name[:80]!r}")
        try:
            if not isinstance(text, str):
                raise ValueError(text)
            out[name] = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise bad(E_META, f"{path}: the stored tokenizer file {name[:80]!r} is not base64") from None
    return out
