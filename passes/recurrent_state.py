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
"""

from __future__ import annotations

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


def cache_recurrences(g: Graph, role: str, slots: int, slot: Value | None) -> int:
    """Make each recurrence of `g` stateful (see the module docstring); returns how many."""
    found = recurrences(g)
    if not found:
        return 0
    last = last_token_input(g) if role != "decode" else None
    for i, n in enumerate(found):
        stateful, prefix = STATEFUL[n.op]
        rows = n.inputs[0].type.shape[0]
        st = g.add_state(f"{prefix}.{i}", TensorType((max(slots, rows), *_state_shape(n)), DType.f32))
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
                reads: list[Value]) -> None:
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
    if s != 1:
        raise InternalError(f"{n.name}: a conv window steps one token at a time, not {s}")
    here = g.add_constant(f"conv_window.{i}.token", TensorType((1,), DType.i64),
                          TensorSource(torch.tensor([width], dtype=torch.int64)))
    appended = write(st, node("reshape", [x], (b, 1, 1, c), {"shape": (b, 1, 1, c)}), here, [])
    win = node("reshape", [appended], (b, width + 1, c), {"shape": (b, width + 1, c)})
    win = node("transpose", [win], (b, c, width + 1), {"perm": (0, 2, 1)})
    o = w.type.shape[0]
    conv = g.add_node("conv1d", [win, w, *n.inputs[2:3]], [TensorType((b, o, 1), n.outputs[0].type.dtype)],
                      {"pads": (0, 0), "stride": 1, "dilation": d, "groups": n.attrs.get("groups", 1)},
                      names=n.name + ".window", before=n)
    moved = node("slice", [win], (b, c, width), {"axis": 2, "start": 1, "end": width + 1, "step": 1})
    g.set_state_update(st, write(appended, as_rows(moved, width), at, []))
    for v in reads:
        g.replace_all_uses_with(v, conv.outputs[0])
        if v.producer is not n:
            g.remove_node(v.producer)
    g.remove_node(n)
