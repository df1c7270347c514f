"""Canonicalisation: every frontend and exporter variant reaches one form, so the
fusions downstream need to know only that form.

    %r = reciprocal(sqrt(%x))            ->  %r = rsqrt(%x)
    %r = div(@one, sqrt(%x))             ->  %r = rsqrt(%x)
    %y = div(%x, sqrt(%v))               ->  %y = mul(%x, rsqrt(%v))
    %y = div(%x, @c)        (float)      ->  %y = mul(%x, @1/c)
    %y = mul(%x, sigmoid(%x))            ->  %y = silu(%x)
    %y = mul(%x, @one)                   ->  %x
    %y = cast[dtype=f32](%x : f32)       ->  %x
    %y = reshape(reshape(%x))            ->  %y = reshape(%x)
    %y = reshape(%x)        (same shape) ->  %x
    %y = matmul(%x, @w : [k, n])         ->  %y = linear[weight_layout="kn"](%x, @w)  (the weight as stored)
    %y = transpose[p](scatter_nd(transpose[p](%x), @rows, transpose[p](%src)))
                                         ->  %y = slice_scatter[axis=a, start:end:step](%x, %src)
         (p swaps axes 0 and a; @rows a constant arithmetic run: how the ONNX exporter
          writes `x[..., start:end] = src`)
    %y = softmax[axis=a](sub(%x, reduce_max[axes=[a], keepdim](%x)))
                                         ->  %y = softmax[axis=a](%x)
         (softmax shifts by the maximum itself: the same values, bit for bit)
    %y = scatter_elements[axis=a](%data, cast*(topk[axis=a, k=n](%x).indices), @u)
                                         ->  %y = @u
         (k = n, the axis' whole length: the indices are a permutation of it, so every
          position is written; @u the same along a, so which gets what does not matter.
          DeepSeek-V3.2's sparse attention selects its keys so: at a length up to its
          index_topk it selects them all, and its mask is the causal one)

    %y = mul(matmul(softmax[axis=-1](%s), %v), sigmoid(sub(logsumexp(%s), @sink)))
                                         ->  %y = matmul(slice[0:L](softmax(concat(%s, @sink_column))), %v)
         (Granite-SWA's sink gate: softmax(s) * sigmoid(lse(s) - sink) is exp(s) / (sum exp(s)
          + exp(sink)), gpt-oss' extra column, which attention fusion takes as `sinks`; the
          logsumexp as the frontends decompose it, max + log(sum(exp(s - max))))

Left alone: a division by a constant with more than one element (x / c is not
x * (1/c) bit for bit when c varies, and the fusions do not need it), and a
matmul whose weight is an activation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from npuc.ir import Value, get_op
from npuc.passes.rewrite import Builder, Match, RewritePass, Rule, any_of, const, is_const, last_axis, op, var


def _is_float(v: Value) -> bool:
    return v.type.dtype.is_float


def _scalar_const(v: Value) -> bool:
    return v.is_const and v.type.numel == 1 and v.type.dtype.is_float


def _div_by_const(b: Builder, m: Match) -> Value:
    c = m.data("c").double()
    inv = (1.0 / c).to(m.data("c").dtype)
    return b.op("mul", [m["x"], b.const(f"{m['c'].name}_inv", inv)])


def _swap0(perm: object) -> int | None:
    """The axis a that `perm` swaps with axis 0 (a self-inverse permutation), else None."""
    p = tuple(perm) if isinstance(perm, (list, tuple)) else ()
    a = p[0] if p else 0
    if a == 0 or a >= len(p) or p[a] != 0 or any(x != i for i, x in enumerate(p) if i not in (0, a)):
        return None
    return a


def _scatter_rows(m: Match) -> tuple[int, int, int, int] | str:
    """(axis, start, end, step) of a scatter_nd that writes a run of rows, or why not."""
    perms = [m.node(k).attrs["perm"] for k in ("outer", "tsrc")] + \
        ([m.node("tx").attrs["perm"]] if "tx" in m.nodes else [])
    a = _swap0(perms[0])
    if a is None or any(tuple(p) != tuple(perms[0]) for p in perms):
        return "the transposes are not one swap of axis 0"
    if m.node("scatter").attrs.get("reduction", "none") != "none" or m["idx"].type.rank != 2 \
            or m["idx"].type.shape[1] != 1 or not getattr(m["idx"].const, "in_memory", False):
        return "not a plain row scatter"
    rows = m.data("idx").reshape(-1).long().tolist()
    step = rows[1] - rows[0] if len(rows) > 1 else 1
    if not rows or step <= 0 or rows != list(range(rows[0], rows[0] + step * len(rows), step)):
        return "the rows are not an arithmetic run"
    return a, rows[0], rows[0] + step * (len(rows) - 1) + 1, step


def _scatter_to_slice_scatter(b: Builder, m: Match) -> Value:
    found = _scatter_rows(m)
    assert not isinstance(found, str), found
    a, start, end, step = found
    x = m["x"] if "x" in m.values else b.op("transpose", [m["data"]], {"perm": m.node("outer").attrs["perm"]})
    return b.op("slice_scatter", [x, m["src"]], {"axis": a, "start": start, "end": end, "step": step})


def _max_shift(m: Match) -> str | None:
    sm, mx = m.node("sm"), m.node("max")
    axis = get_op("softmax").full_attrs(sm.attrs)["axis"] % m["x"].type.rank
    a = get_op("reduce_max").full_attrs(mx.attrs)
    if tuple(x % m["x"].type.rank for x in a["axes"]) != (axis,) or not a["keepdim"]:
        return "the maximum is not over the softmax's axis"
    return None


def _every_position(m: Match) -> str | None:
    """Why scatter-every-position does not apply, or None."""
    scatter = m.node("scatter")
    a = get_op("scatter_elements").full_attrs(scatter.attrs)
    data, idx, upd = scatter.inputs
    axis = a["axis"] % data.type.rank
    if a["reduction"] != "none" or idx.type.shape != data.type.shape or upd.type != data.type:
        return "not a plain scatter over every index of the data"
    v = idx
    while v.producer is not None and v.producer.op == "cast" and not v.type.dtype.is_float \
            and v.type.dtype.itemsize >= 4:  # i64 <-> i32 keeps every index
        v = v.producer.inputs[0]
    t = v.producer
    if t is None or t.op != "topk" or v is not t.outputs[1]:
        return "the indices are not a top-k's"
    ta = get_op("topk").full_attrs(t.attrs)
    if ta["axis"] % data.type.rank != axis or ta["k"] != data.type.shape[axis] or t.inputs[0].type.shape != idx.type.shape:
        return "the top-k does not take the whole axis the scatter writes"
    if not getattr(upd.const, "in_memory", False):
        return "the updates are not a constant in memory"
    u = upd.const.load()
    if not bool((u == u.narrow(axis, 0, 1)).all()):
        return "the updates differ along the axis"
    return None


def _sink_gate_pattern() -> object:
    mx = op("reduce_max", var("s"), bind="mx")
    lse = op("add", op("log", op("reduce_sum", op("exp", op("sub", var("s"), mx)), bind="sum")), mx)
    gate = op("sigmoid", op("sub", any_of(op("reshape", lse), lse), var("sink", is_const)))
    pv = op("matmul", op("softmax", var("s"), bind="sm"), var("v"), bind="pv")
    return op("mul", pv, any_of(op("reshape", gate, bind="gate"), gate))


def _sink_heads(m: Match) -> torch.Tensor | str:
    """The per-head sink logits [h] the gate subtracts from the scores' logsumexp, or why not."""
    s, sm = m["s"], m.node("sm")
    b, h, q, _ = s.type.shape if s.type.rank == 4 else (0, 0, 0, 0)
    if not h or not last_axis(sm):
        return "the softmax is not over the last axis of 4-D scores"
    for name in ("mx", "sum"):
        a = get_op(m.node(name).op).full_attrs(m.node(name).attrs)
        if tuple(x % 4 for x in a["axes"]) != (3,) or not a["keepdim"]:
            return "the logsumexp is not over the keys"
    if m.matched[0].outputs[0].type.shape != m["pv"].type.shape:
        return "the gate broadcasts the attention output"
    t = m.data("sink").float()
    try:
        t = torch.broadcast_to(t, (b, h, q) if t.dim() <= 3 else (b, h, q, 1)).reshape(b, h, q)
    except RuntimeError:
        return f"the sink {m['sink'].type} is not one logit per head"
    if not bool((t == t[:1, :, :1]).all()):
        return "the sink logits vary along batch or queries"
    return t[0, :, 0]


def _sink_gate_rewrite(b: Builder, m: Match) -> Value:
    heads = _sink_heads(m)
    assert not isinstance(heads, str), heads
    s = m["s"]
    bb, h, q, length = s.type.shape
    col = b.const(f"{m['sink'].name}_column", heads.to(s.type.dtype.torch).reshape(1, h, 1, 1).expand(bb, h, q, 1)
                  .contiguous())
    probs = b.op("softmax", [b.op("concat", [s, col], {"axis": 3})], {"axis": 3})
    return b.op("matmul", [b.op("slice", [probs], {"axis": 3, "start": 0, "end": length, "step": 1}), m["v"]])


def _matmul_to_linear(b: Builder, m: Match) -> Value:
    return b.op("linear", [m["x"], m["w"]], {"weight_layout": "kn"})


@dataclass(frozen=True)
class Canonicalize(RewritePass):
    name = "canonicalize"

    def rules(self) -> Sequence[Rule]:
        return [
            Rule("rsqrt-of-reciprocal-sqrt", op("reciprocal", op("sqrt", var("x"))),
                 lambda b, m: b.op("rsqrt", [m["x"]])),
            Rule("rsqrt-of-one-over-sqrt", op("div", const(value=1.0), op("sqrt", var("x"))),
                 lambda b, m: b.op("rsqrt", [m["x"]]),
                 check=lambda m: None if m.matched[0].outputs[0].type == m["x"].type
                 else "the constant broadcasts the result"),
            Rule("div-by-sqrt", op("div", var("x"), op("sqrt", var("v"))),
                 lambda b, m: b.op("mul", [m["x"], b.op("rsqrt", [m["v"]])])),
            Rule("div-by-const", op("div", var("x", _is_float), var("c", _scalar_const)), _div_by_const),
            Rule("silu", op("mul", var("x"), op("sigmoid", var("x"))), lambda b, m: b.op("silu", [m["x"]])),
            Rule("mul-by-one", op("mul", var("x"), const(value=1.0)), lambda b, m: m["x"],
                 check=lambda m: None if m.values["x"].type == m.matched[0].outputs[0].type
                 else "the constant broadcasts the result"),
            Rule("identity-cast", op("cast", var("x"), where=lambda n: n.inputs[0].type.dtype == n.attrs["dtype"]),
                 lambda b, m: m["x"]),
            Rule("reshape-chain", op("reshape", op("reshape", var("x")), bind="outer"),
                 lambda b, m: b.op("reshape", [m["x"]], {"shape": m["outer"].type.shape})),
            Rule("identity-reshape", op("reshape", var("x"), where=lambda n: n.inputs[0].type == n.outputs[0].type),
                 lambda b, m: m["x"]),
            Rule("scatter-nd-to-slice-scatter",
                 op("transpose", op("scatter_nd", any_of(op("transpose", var("x"), bind="tx"), const("data")),
                                    const("idx"), op("transpose", var("src"), bind="tsrc"), bind="scatter"),
                    bind="outer"),
                 _scatter_to_slice_scatter, check=lambda m: r if isinstance(r := _scatter_rows(m), str) else None),
            Rule("softmax-of-max-shift", op("softmax", op("sub", var("x"), op("reduce_max", var("x"), bind="max")),
                                            bind="sm"),
                 lambda b, m: b.op("softmax", [m["x"]], m.node("sm").attrs), check=_max_shift),
            Rule("scatter-every-position", op("scatter_elements", var("data"), var("idx"), var("upd", is_const),
                                              bind="scatter"),
                 lambda b, m: m["upd"], check=_every_position),
            Rule("sink-gate-to-sink-column", _sink_gate_pattern(), _sink_gate_rewrite,
                 check=lambda m: r if isinstance(r := _sink_heads(m), str) else None),
            Rule("matmul-to-linear",
                 op("matmul", var("x", lambda v: v.type.rank >= 2),
                    var("w", lambda v: v.is_const and v.type.rank == 2)), _matmul_to_linear),
        ]
