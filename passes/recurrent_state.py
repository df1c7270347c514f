"""Recurrent state for the kv-cache pass: each recurrence (a `selective_scan` or
`gated_delta_rule`, ir/recurrent_ops.py) becomes its stateful op over a `.om` state of one
row per slot, shared by the prefill and decode programs. kv_cache.py calls `cache_recurrences`
once per program, after it has made the program's `position` (decode) or `slot` (prefill
of several slots) inputs.

    prefill (one sequence, the prompt right-padded to S):
      %y = selective_scan(%x, %dt, @A, %B, %C, @D)
    ->
      state %ssm_state.0 : f32[slots, Dc, N]
      %s, %y = selective_scan_state(%ssm_state.0, %x, %dt, @A, %B, %C, @D, %last_token, %slot)
      update %ssm_state.0 = %s

    decode (every slot, C tokens each):
      %s, %y = selective_scan_state(%ssm_state.0, %x, %dt, @A, %B, %C, @D)

The prefill starts from zeros and keeps the state after its `last_token` row, the prompt's
last: the padding after it never enters the state, and a slot refilled by a new request
starts clean whatever its last request left (the slot-reuse bug of runtimes that keep the
state apart from the prefill). A program whose prefill has no `last_token` input gets one
here; passes/last_token_logits.py then computes its logits row from the same input.

The states' size does not depend on --max_seq_len: `npuc info` reports them per slot.

The verify program (--speculative_tokens K: C = K + 1 tokens of each slot) also keeps each
state as it was after each of its rows but the last, so that a rejected draft is undone in
O(1): the scheduler copies row j's state back (Session.rollback, npuc_session_rollback)
where only rows 0..j < K of a slot were kept, whatever the sequence's length (all K + 1
kept: the state is already right). Each recurrence (and each conv window beside them) runs
its rows one at a time, a decode step's op per row, and writes the state after row r < K
into `<state>.by_row` [slots, 1, K, n] (n the state's values per slot) at row r:

      %s0, %y0 = gated_delta_rule_state(%delta_state.0, slice[axis=1, 0..1](%q), ...)
      %b0 = kv_write(%delta_state.0.by_row, reshape(%s0), @0)
      %s1, %y1 = gated_delta_rule_state(%s0, slice[axis=1, 1..2](%q), ...)
      %b1 = kv_write(%b0, reshape(%s1), @1)
      ...
      %y = concat[axis=1](%y0, %y1, ..., %yK)
      update %delta_state.0 = %sK, %delta_state.0.by_row = %bK-1

The rows a slot pads its step with (no drafts, or fewer than K) advance the state too; the
rollback to the slot's last kept row undoes them with the rest. The copies cost K states'
bytes a verify step, the memory K states a slot (`npuc info`).
"""

from __future__ import annotations

import math

import torch

from npuc.errors import InternalError
from npuc.ir import DType, Graph, Node, TensorSource, TensorType, Value
from npuc.passes.last_token_logits import LAST_TOKEN

# The pure op -> (its stateful form, the state's name prefix)
STATEFUL = {"selective_scan": ("selective_scan_state", "ssm_state"),
            "gated_delta_rule": ("gated_delta_rule_state", "delta_state"),
            "wkv": ("wkv_state", "wkv_state"),
            "linear_recurrence": ("linear_recurrence_state", "lru_state"),
            "linear_attention": ("linear_attention_state", "linear_state")}
STATE_PREFIXES = (*(prefix + "." for _, prefix in STATEFUL.values()), "conv_window.")
# A verify program's copy of a state after each of its rows: the state's name plus this (the
# .om format's name, which backend/om_schema.ROLLBACK_SUFFIX gives the runtime and tools)
BY_ROW = ".by_row"
# Each pure recurrence's operands that run along the sequence, [b, S, ...] (the others are
# per channel: a decay rate, a skip weight, a bonus)
SEQ_OPERANDS = {"selective_scan": (0, 1, 3, 4), "gated_delta_rule": (0, 1, 2, 3, 4), "wkv": (0, 1),
                "linear_recurrence": (0, 1), "linear_attention": (0, 1, 2, 3)}


def recurrences(g: Graph) -> list[Node]:
    return [n for n in g.nodes if n.op in STATEFUL]


def has_recurrent_state(g: Graph) -> bool:
    return any(name.startswith(STATE_PREFIXES) for name in g.states)


def _state_shape(n: Node) -> tuple[int, ...]:
    if n.op == "selective_scan":
        x, b = n.inputs[0], n.inputs[3]
        return (x.type.shape[2], b.type.shape[3])
    if n.op == "wkv":
        return (3, n.inputs[0].type.shape[2])
    if n.op == "linear_recurrence":
        return (n.inputs[0].type.shape[2],)
    q, v = n.inputs[0], n.inputs[2]
    return (q.type.shape[2], q.type.shape[3], v.type.shape[3])


def last_token_input(g: Graph) -> Value:
    """The prefill's `last_token` input i64[1], made if it has none yet."""
    for v in g.inputs:
        if v.name == LAST_TOKEN:
            return v
    return g.add_input(LAST_TOKEN, TensorType((1,), DType.i64))


class _ByRow:
    """A state's copies after each row of a verify step but the last, `<state>.by_row`
    [slots, 1, C - 1, n] (the state after the last is the state's own update)."""

    def __init__(self, g: Graph, state: Value, rows: int, before: Node) -> None:
        self.g, self.before, self.slots = g, before, state.type.shape[0]
        self.per = math.prod(state.type.shape[1:])
        self.state = g.add_state(state.name + BY_ROW,
                                 TensorType((self.slots, 1, rows - 1, self.per), state.type.dtype))
        self.cur = self.state

    def keep(self, v: Value, r: int) -> None:
        """Write `v` (the state after row r < C - 1) as row r, before anything that follows
        updates it."""
        g, name = self.g, f"{self.state.name}.{r}"
        flat = g.add_node("reshape", [v], [TensorType((self.slots, 1, 1, self.per), v.type.dtype)],
                          {"shape": (self.slots, 1, 1, self.per)}, names=name, before=self.before).outputs[0]
        at = g.add_constant(f"{name}.at", TensorType((1,), DType.i64), TensorSource(torch.tensor([r])))
        self.cur = g.add_node("kv_write", [self.cur, flat, at], [self.state.type], names=f"{name}.write",
                              before=self.before).outputs[0]

    def done(self) -> None:
        self.g.set_state_update(self.state, self.cur)


def _row(g: Graph, v: Value, axis: int, r: int, before: Node) -> Value:
    shape = list(v.type.shape)
    shape[axis] = 1
    return g.add_node("slice", [v], [TensorType(tuple(shape), v.type.dtype)],
                      {"axis": axis, "start": r, "end": r + 1, "step": 1}, names=f"{v.name}.row{r}",
                      before=before).outputs[0]


def _by_rows(g: Graph, n: Node, st: Value, stateful: str) -> Node:
    """Recurrence `n` (a decode of C > 1 rows of each slot) as C one-row steps over state
    `st`, each step's state kept by row (the module docstring); returns the node whose
    outputs replace n's: the concat of the rows' outputs."""
    rows = n.inputs[0].type.shape[1]
    seq = SEQ_OPERANDS[n.op]
    by_row = _ByRow(g, st, rows, n)
    y = n.outputs[0].type
    cur, outs = st, []
    for r in range(rows):
        ins = [_row(g, v, 1, r, n) if j in seq else v for j, v in enumerate(n.inputs)]
        step = g.add_node(stateful, [cur, *ins], [st.type, TensorType((y.shape[0], 1, *y.shape[2:]), y.dtype)],
                          names=[f"{st.name}.update.{r}", f"{n.outputs[0].name}.row{r}"], before=n)
        cur = step.outputs[0]
        if r < rows - 1:  # (after the last, the state's own update)
            by_row.keep(cur, r)
        outs.append(step.outputs[1])
    g.set_state_update(st, cur)
    by_row.done()
    return g.add_node("concat", outs, [n.outputs[0].type], {"axis": 1}, names=f"{n.outputs[0].name}.rows", before=n)


def cache_recurrences(g: Graph, role: str, slots: int, slot: Value | None, by_row: bool = False) -> int:
    """Make each recurrence of `g` stateful (see the module docstring); returns how many.
    `by_row`: a decode program of C > 1 rows of each slot (verify) keeps the states after
    each row; without it such a program is an internal error (the kv-cache pass refuses it)."""
    found = recurrences(g)
    if not found:
        return 0
    last = last_token_input(g) if role != "decode" else None
    for i, n in enumerate(found):
        stateful, prefix = STATEFUL[n.op]
        rows = n.inputs[0].type.shape[0]
        st = g.add_state(f"{prefix}.{i}", TensorType((max(slots, rows), *_state_shape(n)), DType.f32))
        if role == "decode" and n.inputs[0].type.shape[1] > 1:
            if not by_row:
                raise InternalError(f"{n.name}: a decode of several rows of each slot without their states by row")
            name = n.outputs[0].name
            new = _by_rows(g, n, st, stateful)
            g.replace_all_uses_with(n.outputs[0], new.outputs[0])
            g.remove_node(n)
            g.rename(new.outputs[0], name)
            continue
        tail = [] if last is None else [last, *([slot] if slot is not None else [])]
        out = n.outputs[0]
        new = g.add_node(stateful, [st, *n.inputs, *tail], [st.type, out.type], names=[f"{prefix}.{i}.update", f"{out.name}.stateful"],
                         before=n)
        g.set_state_update(st, new.outputs[0])
        g.replace_all_uses_with(out, new.outputs[1])
        name = out.name
        g.remove_node(n)
        g.rename(new.outputs[1], name)
    return len(found)


def conv_window(g: Graph, n: Node, i: int, role: str, slots: int, slot: Value | None,
                reads: list[Value], by_row: bool = False) -> None:
    """The causal conv `n` (reads: what reads its outputs 0..s-1) keeps its last W inputs,
    W = dilation * (k - 1), in a state `conv_window.<i>` of [slots, 1, W + 1, channels]
    (rows 0..W-1 the window, row W the token being decoded), the same size at any
    --max_seq_len (where a model has recurrences, whose states are too). Each program reads
    the state once, through its in-place writes:

      prefill: the conv as it is; the window, rows last-W+1 .. last (zeros before 0):
        %p = pad[pads=[0,0,W,0,0,0]](%x)                         x [1, c, S]
        %r = gather[axis=2](%p, add(%last_token, @1..W))          [1, c, W]
        %w = kv_write(%conv_window.0, rows(%r), @0..W-1, %slot)
      decode (one token of each slot):
        %a = kv_write(%conv_window.0, rows(%x), @W)              the window and the token
        %win = transpose(reshape(%a))                              [slots, c, W + 1]
        %y = conv1d[no padding](%win, @w)                          [slots, o, 1]
        %w = kv_write(%a, rows(slice[1..W+1](%win)), @0..W-1)     the window moves on
      verify (`by_row`: C tokens of each slot): the window and the C rows as one sequence
      of W + C rows, convolved once; the last W rows the new window, and rows r+1 .. r+W
      (the window after row r < C - 1) kept by row (`conv_window.<i>.by_row`)
    """
    x, w = n.inputs[0], n.inputs[1]
    b, c, s = x.type.shape
    k, d = w.type.shape[2], n.attrs.get("dilation", 1)
    width = d * (k - 1)
    dt = x.type.dtype
    st = g.add_state(f"conv_window.{i}", TensorType((max(slots, b), 1, width + 1, c), dt))
    at = g.add_constant(f"conv_window.{i}.rows", TensorType((width,), DType.i64),
                        TensorSource(torch.arange(width, dtype=torch.int64)))

    def node(op: str, ins: list[Value], shape: tuple[int, ...], attrs: dict[str, object] | None = None,
             dtype: DType = dt) -> Value:
        return g.add_node(op, ins, [TensorType(shape, dtype)], attrs or {}, names=f"conv_window.{i}.{op}",
                          before=n).outputs[0]

    def as_rows(v: Value, r: int) -> Value:  # [b, c, r] -> [b, 1, r, c]
        v = node("transpose", [v], (b, r, c), {"perm": (0, 2, 1)})
        return node("reshape", [v], (b, 1, r, c), {"shape": (b, 1, r, c)})

    def write(cache: Value, rows: Value, pos: Value, extra: list[Value]) -> Value:
        return g.add_node("kv_write", [cache, rows, pos, *extra], [st.type], names=f"conv_window.{i}.write",
                          before=n).outputs[0]

    if role != "decode":
        ahead = g.add_constant(f"conv_window.{i}.ahead", TensorType((width,), DType.i64),
                               TensorSource(torch.arange(1, width + 1, dtype=torch.int64)))
        padded = node("pad", [x], (b, c, s + width), {"pads": (0, 0, width, 0, 0, 0)})
        idx = node("add", [last_token_input(g), ahead], (width,), dtype=DType.i64)
        rows = as_rows(node("gather", [padded, idx], (b, c, width), {"axis": 2}), width)
        g.set_state_update(st, write(st, rows, at, [slot] if slot is not None else []))
        return
    if s != 1 and not by_row:
        raise InternalError(f"{n.name}: a conv window steps one token at a time, not {s}")
    here = g.add_constant(f"conv_window.{i}.token", TensorType((1,), DType.i64),
                          TensorSource(torch.tensor([width], dtype=torch.int64)))
    o = w.type.shape[0]
    conv_attrs = {"pads": (0, 0), "stride": 1, "dilation": d, "groups": n.attrs.get("groups", 1)}

    def conv(v: Value, rows: int) -> Value:
        return g.add_node("conv1d", [v, w, *n.inputs[2:3]], [TensorType((b, o, rows), n.outputs[0].type.dtype)],
                          conv_attrs, names=n.name + ".window", before=n).outputs[0]

    if s == 1:
        appended = write(st, node("reshape", [x], (b, 1, 1, c), {"shape": (b, 1, 1, c)}), here, [])
        win = node("reshape", [appended], (b, width + 1, c), {"shape": (b, width + 1, c)})
        win = node("transpose", [win], (b, c, width + 1), {"perm": (0, 2, 1)})
        y = conv(win, 1)
        moved = node("slice", [win], (b, c, width), {"axis": 2, "start": 1, "end": width + 1, "step": 1})
        g.set_state_update(st, write(appended, as_rows(moved, width), at, []))
    else:  # verify: the window and the step's s rows as one sequence of W + s rows, convolved once
        last = node("slice", [x], (b, c, 1), {"axis": 2, "start": s - 1, "end": s, "step": 1})
        # (row W is scratch: written first, so that the state has one reader, which updates it)
        appended = write(st, node("reshape", [last], (b, 1, 1, c), {"shape": (b, 1, 1, c)}), here, [])
        old = node("slice", [appended], (b, 1, width, c), {"axis": 2, "start": 0, "end": width, "step": 1})
        old = node("reshape", [old], (b, width, c), {"shape": (b, width, c)})
        seq = g.add_node("concat", [old, node("transpose", [x], (b, s, c), {"perm": (0, 2, 1)})],
                         [TensorType((b, width + s, c), dt)], {"axis": 1}, names=f"conv_window.{i}.rows",
                         before=n).outputs[0]
        y = conv(node("transpose", [seq], (b, c, width + s), {"perm": (0, 2, 1)}), s)
        new = node("slice", [seq], (b, width, c), {"axis": 1, "start": s, "end": s + width, "step": 1})
        g.set_state_update(st, write(appended, node("reshape", [new], (b, 1, width, c), {"shape": (b, 1, width, c)}),
                                     at, []))
        kept = _ByRow(g, st, s, n)
        for r in range(s - 1):  # the window after row r: rows r+1 .. r+W (and one of scratch)
            kept.keep(node("slice", [seq], (b, width + 1, c), {"axis": 1, "start": r + 1, "end": r + width + 2,
                                                                  "step": 1}), r)
        kept.done()
    for v in reads:
        g.replace_all_uses_with(v, y)
        if v.producer is not n:
            g.remove_node(v.producer)
    g.remove_node(n)
