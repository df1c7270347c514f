"""Attention scores: one scale and one additive mask, however hand-written attention spells them.

Between the product q @ k^T and the softmax, hand-written attention scales and masks its
scores in many spellings; attention fusion knows one. Each chain of elementwise ops whose
only activation is the scores (every other operand a constant in memory) is rewritten when
probing shows that it computes `scale * s + mask`:

    %s = matmul(%q, transpose[perm=[0,2,3,1]](%k_bshd))            (k^T straight from [b, s, h, d])
    %y = add(mul(mul(%s, @inv_sqrt_d), @tril01), @fill)            (GPT: s * b + -1e4 * (1 - b))
    %y = add(where(@tril, %s, @finfo_min), @padding)               (GPT-Neo)
    %y = maximum(add(%s, @mask), @finfo_min)                       (clamped, XGLM and OPT style)
    %p = softmax[axis=-1](%y)
  ->
    %s = matmul(%q, transpose[perm=[0,1,3,2]](transpose[perm=[0,2,1,3]](%k_bshd)))
    %p = softmax[axis=-1](add(mul(%s, @scale), @mask))             (@mask: -inf where a key is hidden)

Batched 3-D products (`bmm`/`baddbmm` over [b*h, q, d]) are lifted to the 4-D form that
fusion reads, with the probabilities' product too:

    %s3 = matmul(%q3, %kt3)      %s4 = reshape[[b,h,q,k]](chain3(%s3))      (GPT-NeoX-Japanese, Bloom)
    %p3 = softmax(reshape[[b*h,q,k]](chain4(%s4)))   %y3 = matmul(%p3, %v3)  (XGLM)
  ->
    %p4 = softmax(add(mul(matmul(reshape4(%q3), reshape4(%kt3)), @scale), @mask))
    %y3 = reshape[[b*h,q,d]](matmul(%p4, reshape[[b,h,k,d]](%v3)))

A last `add` of a mask the program computes (a decode step's, from its position ids) is
kept: the chain before it is rewritten, and that mask is added to the constant one.

The probe runs the chain's own reference kernels on scores of the constants' broadcast
shape (each constant first kept at size 1 along every axis it is uniform along; never the
full [b, h, q, k] product where the constants do not span it): f(0) gives the mask, f at
two random score tensors (|s| < 30) the scale, which must fit every shown entry to
rounding. A key counts as hidden where f puts it at or below -1e4 at every probe: its exp
is 0 next to any shown key in every float type, as it would be at -inf. Rows with no
shown key are left alone (their softmax is not a masked one).

Left alone: chains already in the form above, chains through other ops (tanh soft-capping
is matched by attention fusion itself), scores that are not [b, h, q, k] or its [b*h, q, k]
merge throughout, a probe over more than 2^24 elements (a per-head bias, such as ALiBi's,
at a long sequence), and any chain the probe does not show affine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from npuc.errors import InternalError
from npuc.ir import Graph, Node, Value, get_op
from npuc.ir.ops import broadcast
from npuc.passes.dce import DeadCodeElimination
from npuc.passes.manager import PassResult
from npuc.passes.rewrite import Builder, Match, RewritePass, Rule, last_axis, op, var

_ELEMENTWISE = frozenset({"add", "sub", "mul", "div", "where", "maximum", "minimum"})
_HIDDEN = -1e4
_PROBE_LIMIT = 1 << 24
_K_FROM_BSHD = (0, 2, 3, 1)


def _in_memory(v: Value) -> bool:
    return v.const is not None and bool(getattr(v.const, "in_memory", False))


def _scalar(v: Value) -> bool:
    return _in_memory(v) and v.type.numel == 1


@dataclass(frozen=True)
class _Chain:
    scores: Value  # the matmul's result: [b, h, q, k], or [b*h, q, k] (a batched product)
    nodes: tuple[Node, ...]  # scores -> softmax input, in order (elementwise ops and reshapes)
    runtime: Value | None = None  # a mask computed at run time, added last (from position ids)

    def shape4(self) -> tuple[int, ...] | None:
        """The chain's [b, h, q, k]: the 4-D shape among the scores and the chain's values,
        every other one its [b*h, q, k] merge; None where they are not that."""
        shapes = [self.scores.type.shape] + [n.outputs[0].type.shape for n in self.nodes]
        four = next((sh for sh in shapes if len(sh) == 4), None)
        if four is None:
            return None
        b, h, q, k = four
        ok = all(sh == four or sh == (b * h, q, k) for sh in shapes)
        return four if ok else None

    def flat(self) -> bool:
        """Whether any value of the chain (the scores included) is the [b*h, q, k] merge."""
        return any(v.type.rank == 3 for v in [self.scores] + [n.outputs[0] for n in self.nodes])


def _chain(x: Value) -> _Chain | str:
    """The elementwise chain from a score product to the softmax input `x`. Its last op may add
    a mask the program computes (a decode step's, from its position ids input): that term is
    kept as it is, added after the rest."""
    n = x.producer
    if n is not None and n.op == "add" and not any(v.is_const for v in n.inputs):
        for chain_in, term in ((n.inputs[0], n.inputs[1]), (n.inputs[1], n.inputs[0])):
            inner = _const_chain(chain_in)
            if not isinstance(inner, str) and inner.nodes and x.type.rank == 4 and not inner.flat():
                return _Chain(inner.scores, inner.nodes, term)
    return _const_chain(x)


def _const_chain(x: Value) -> _Chain | str:
    nodes: list[Node] = []
    while True:
        n = x.producer
        if n is None:
            return "the softmax does not read a score product"
        if n.op == "matmul":
            return _Chain(x, tuple(reversed(nodes)))
        if n.op == "reshape":
            nodes.append(n)
            x = n.inputs[0]
            continue
        if n.op not in _ELEMENTWISE or len(n.outputs) != 1:
            return f"the scores pass through {n.op}"
        acts = [v for v in n.inputs if not v.is_const]
        if len(acts) != 1 or not all(_in_memory(v) for v in n.inputs if v.is_const):
            return f"{n.name} reads more than the scores and constants in memory"
        if n.op == "where" and n.inputs[0] is acts[0]:
            return f"{n.name} selects by the scores"
        nodes.append(n)
        x = acts[0]


def _canonical(c: _Chain) -> bool:
    """Already what attention fusion matches: scalar scalings, then at most one mask (a constant
    added, a boolean where that puts -inf, or a computed one added), all 4-D."""
    if c.flat() or any(n.op == "reshape" for n in c.nodes):
        return False
    rest = list(c.nodes)
    while rest and rest[0].op in ("mul", "div") and _scalar(rest[0].inputs[1]):
        rest.pop(0)
    if not rest or c.runtime is not None:  # a computed mask (or a key bias and a mask) added last
        return not rest
    return len(rest) == 1 and (rest[0].op == "add" or (rest[0].op == "where" and not rest[0].inputs[1].is_const))


def _k_perm(c: _Chain) -> bool:
    """k^T taken straight from [b, s, h, d] (transpose [0, 2, 3, 1]): rebuilt as fusion reads it."""
    kt = c.scores.producer.inputs[1] if c.scores.producer is not None else None
    t = kt.producer if kt is not None else None
    return t is not None and t.op == "transpose" and tuple(t.attrs["perm"]) == _K_FROM_BSHD


def _compressed(t: torch.Tensor) -> torch.Tensor:
    """A constant with each axis it is uniform along kept at size 1 (it broadcasts back)."""
    for ax in range(t.dim()):
        if t.shape[ax] > 1 and bool((t == t.narrow(ax, 0, 1)).all()):
            t = t.narrow(ax, 0, 1)
    return t


def _steps(c: _Chain, shape4: tuple[int, ...]) -> list[tuple[Node, list[torch.Tensor | None]]]:
    """The chain's elementwise ops over 4-D values: each constant in memory as [b, h, q, k]
    broadcasts it (a [b*h, ..] one split, any one compressed); None stands for the activation."""
    b, h = shape4[0], shape4[1]
    out: list[tuple[Node, list[torch.Tensor | None]]] = []
    for n in c.nodes:
        if n.op == "reshape":
            continue
        ins: list[torch.Tensor | None] = []
        for v in n.inputs:
            if not v.is_const:
                ins.append(None)
                continue
            t = v.const.load()
            if t.dim() == 3 and n.outputs[0].type.rank == 3:
                t = t.reshape((b, h) + tuple(t.shape[1:])) if t.shape[0] == b * h else t.unsqueeze(0)
            if 0 < t.dim() < 4:  # right-aligned broadcasting: the same constant, 4-D
                t = t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))
            ins.append(_compressed(t))
        out.append((n, ins))
    return out


Mask = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # whole, or (key bias, shared mask)


def _affine(c: _Chain) -> tuple[float, Mask] | str:
    """(scale, additive mask) that the chain computes, by probing it; or why it is not that. The
    mask is whole, or (per-head key bias [b, h, 1, k], mask [1, 1, q, k]) where its probe would be
    too large whole: each head is then probed on its own, and must be that split."""
    shape4 = c.shape4()
    if shape4 is None:
        return "the chain's values are not [b, h, q, k] or its [b*h, q, k] merge"
    steps = _steps(c, shape4)
    try:
        shape = broadcast(*(tuple(t.shape) for _, ins in steps for t in ins if t is not None))
    except ValueError:
        return "the constants do not broadcast together"
    shape = (1,) * (4 - len(shape)) + shape
    if len(shape) != 4 or broadcast(shape, shape4) != shape4:
        return "the constants broadcast the scores to another shape"
    dt = c.scores.type.dtype.torch
    if shape[0] * shape[1] * shape[2] * shape[3] <= _PROBE_LIMIT:
        return _probe(steps, shape, dt)
    if shape[2] * shape[3] > _PROBE_LIMIT:
        return f"a probe of {shape[2] * shape[3]} elements per head is too large"
    scale, qk, biases = 0.0, torch.empty(0), list[torch.Tensor]()
    for bi in range(shape[0]):
        for hi in range(shape[1]):
            one = [(n, [t if t is None or t.dim() < 4 else t.narrow(0, bi if t.shape[0] > 1 else 0, 1)
                        .narrow(1, hi if t.shape[1] > 1 else 0, 1) for t in ins]) for n, ins in steps]
            found = _probe(one, (1, 1, shape[2], shape[3]), dt)
            if isinstance(found, str):
                return found
            split = key_bias_split(found[1])
            bias, mask = split if split is not None else (torch.zeros(1, 1, 1, shape[3], dtype=dt), found[1])
            if split is None and bool((mask.isfinite() & (mask != 0)).any()):
                return "a head's mask is more than a bias on each key and a shared mask"
            if not biases:
                scale, qk = found[0], mask
            elif not torch.equal(mask, qk) or abs(found[0] - scale) > 1e-6 * scale:
                return "the heads differ in scale or in the keys they hide"
            biases.append(bias)
    return scale, (torch.cat(biases).reshape(shape[0], shape[1], 1, shape[3]), qk)


def _probe(steps: list[tuple[Node, list[torch.Tensor | None]]], shape: tuple[int, ...], dt: torch.dtype
           ) -> tuple[float, torch.Tensor] | str:
    """(scale, mask [shape]) of the chain's steps, probed on scores of `shape`."""
    gen = torch.Generator().manual_seed(0)
    probes = [torch.zeros(shape, dtype=dt)] + [(torch.rand(shape, generator=gen) * 60 - 30).to(dt) for _ in range(2)]

    def run(x: torch.Tensor) -> torch.Tensor:
        for n, ins in steps:
            x = get_op(n.op).run([x if t is None else t for t in ins], n.attrs)[0]
        return x

    outs = [run(p).double() for p in probes]
    if any(tuple(o.shape) != shape for o in outs):
        return "the chain changes the probe's shape"
    hidden = torch.stack([o <= _HIDDEN for o in outs])
    if not bool((hidden == hidden[:1]).all()):
        return "a key is hidden at some scores and shown at others"
    hidden = hidden[0]
    if not bool((~hidden).any(dim=-1).all()):
        return "a row hides every key"
    shown = ~hidden
    mask = outs[0]
    xs = [p.double()[shown] for p in probes[1:]]
    ds = [(o - mask)[shown] for o in outs[1:]]
    scale = float(sum((d * x).sum() for d, x in zip(ds, xs, strict=True)) / sum((x * x).sum() for x in xs))
    if not scale > 0 or scale != scale:
        return f"the scores are scaled by {scale:g}"
    eps = torch.finfo(dt).eps * 8
    for d, x in zip(ds, xs, strict=True):
        if not bool(((d - scale * x).abs() <= eps * ((scale * x).abs() + mask[shown].abs() + 1)).all()):
            return "the chain is not a scale and an additive mask"
    return scale, torch.where(hidden, float("-inf"), mask).to(dt)


def key_bias_split(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A mask [b, h, q, k] as `bias + qk`: bias [b, h, 1, k] a bias on each key per head (ALiBi's),
    qk [1, 1, q, k] 0 where a key is shown and -inf where hidden, the same for every head; None
    where it is not that, or has no bias."""
    if mask.dim() != 4 or mask.shape[2] == 1:
        return None
    t = mask.double()
    shown = t > _HIDDEN
    if not bool((shown == shown[:1, :1]).all()):
        return None
    bias = torch.where(shown, t, float("-inf")).amax(dim=2, keepdim=True)  # from the rows that show each key
    bias = torch.where(torch.isfinite(bias), bias, 0.0)
    if not bool((bias != 0).any()) or \
            not bool(((t - bias).abs() <= 1e-5 * (bias.abs() + 1))[shown.expand_as(t)].all()):
        return None
    qk = torch.zeros(shown.shape[2:], dtype=torch.float64).masked_fill(~shown[0, 0], float("-inf"))
    return bias.to(mask.dtype), qk[None, None].to(mask.dtype)


class _Probed:
    """check and rewrite of one rule: the rewrite takes the chain and probe its check just found
    for the same softmax (probing a long mask head by head is the pass's cost), not again."""

    def __init__(self) -> None:
        self.last: tuple[int, _Chain, tuple[float, Mask] | None] | None = None

    def check(self, m: Match) -> str | None:
        self.last = None
        sm = m.node("sm")
        if not last_axis(sm) or m["x"].type.rank not in (3, 4):
            return "not a softmax over the keys of 3-D or 4-D scores"
        c = _chain(m["x"])
        if isinstance(c, str):
            return c
        if c.shape4() is None:
            return "the scores are not [b, h, q, k] (or its [b*h, q, k] merge) throughout"
        if _canonical(c) and not _k_perm(c):
            return "already one scale and one mask"
        if c.flat() and c.scores.type.rank == 3 and any(v.type.rank != 3 for v in c.scores.producer.inputs):
            return "a batched product of operands that are not 3-D"
        found = _affine(c) if c.nodes else None
        if isinstance(found, str):
            return found
        self.last = (id(sm), c, None if _canonical(c) else found)  # canonical: only k^T is rebuilt
        return None

    def rewrite(self, b: Builder, m: Match) -> Value:
        if self.last is None or self.last[0] != id(m.node("sm")):
            raise InternalError("score-chain rewrote a softmax its check did not pass")
        _, c, found = self.last
        self.last = None
        return _rewrite(b, m, c, found)


def _rewrite(b: Builder, m: Match, c: _Chain, found: tuple[float, Mask] | None) -> Value:
    shape4 = c.shape4()
    assert shape4 is not None
    s = c.scores
    mm = s.producer
    assert mm is not None
    if s.type.rank == 3:  # the batched product, as [b, h] products: fusion reads q and k^T 4-D
        bb, h, q, k = shape4
        lhs, rhs = mm.inputs
        s = b.op("matmul", [b.op("reshape", [lhs], {"shape": (bb, h, q, lhs.type.shape[2])}, name=f"{lhs.name}_4d"),
                            b.op("reshape", [rhs], {"shape": (bb, h, rhs.type.shape[1], k)}, name=f"{rhs.name}_4d")],
                 name=s.name)
    elif _k_perm(c):
        kt = mm.inputs[1]
        k4 = b.op("transpose", [kt.producer.inputs[0]], {"perm": (0, 2, 1, 3)}, name=f"{kt.name}_k")
        s = b.op("matmul", [mm.inputs[0], b.op("transpose", [k4], {"perm": (0, 1, 3, 2)}, name=f"{kt.name}_kt")],
                 name=s.name)
    if found is not None:
        scale, whole = found
        dt = c.scores.type.dtype.torch
        if scale != 1.0:
            s = b.op("mul", [s, b.const(f"{s.name}_scale", torch.tensor(scale, dtype=dt))])
        split = whole if isinstance(whole, tuple) else key_bias_split(whole)
        mask = whole if not isinstance(whole, tuple) else whole[1]
        if split is not None:  # a per-head bias on each key (ALiBi's) and one mask for every head
            extra: Value | None = b.op("add", [b.const(f"{s.name}_key_bias", split[0]),
                                              b.const(f"{s.name}_mask", split[1])], name=f"{s.name}_masks")
        else:
            extra = b.const(f"{s.name}_mask", mask) if bool((mask != 0).any()) else None
        if c.runtime is not None:
            extra = c.runtime if extra is None else b.op("add", [extra, c.runtime], name=f"{s.name}_masks")
        if extra is not None:
            s = b.op("add", [s, extra])
    elif c.nodes:  # canonical already: only k^T changed, the chain is rebuilt on the new scores
        for n in c.nodes:
            s = b.op(n.op, [v if v.is_const else s for v in n.inputs], n.attrs)
    y = b.op("softmax", [s], {"axis": 3})
    root = m.node("sm").outputs[0]
    return y if root.type.rank == 4 else b.op("reshape", [y], {"shape": root.type.shape}, name=f"{root.name}_3d")


def _pv_check(m: Match) -> str | None:
    p4, p3, v3 = m["p4"], m.node("p3r").outputs[0], m["v3"]
    if p4.producer is None or p4.producer.op != "softmax" or p4.type.rank != 4 or p3.type.rank != 3:
        return "not a 4-D softmax viewed 3-D"
    bb, h, q, k = p4.type.shape
    if p3.type.shape != (bb * h, q, k) or v3.type.rank != 3 or v3.type.shape[:2] != (bb * h, k):
        return "the probabilities and values are not [b*h, q, k] and [b*h, k, d]"
    return None


def _pv_rewrite(b: Builder, m: Match) -> Value:
    p4, v3 = m["p4"], m["v3"]
    bb, h, q, k = p4.type.shape
    d = v3.type.shape[2]
    v4 = b.op("reshape", [v3], {"shape": (bb, h, k, d)}, name=f"{v3.name}_4d")
    return b.op("reshape", [b.op("matmul", [p4, v4])], {"shape": (bb * h, q, d)})


@dataclass(frozen=True)
class ScoreChain(RewritePass):
    name = "score-chain"

    def rules(self) -> Sequence[Rule]:
        probed = _Probed()
        return [Rule("score-scale-and-mask", op("softmax", var("x"), bind="sm"), probed.rewrite, probed.check),
                Rule("batched-probabilities-4d", op("matmul", op("reshape", var("p4"), bind="p3r"), var("v3")),
                     _pv_rewrite, _pv_check)]

    def call(self, g: Graph) -> PassResult:
        res = super().call(g)
        if res.modified:  # the old chains still read the scores: fusion must see them gone
            DeadCodeElimination()(g)
        return res
