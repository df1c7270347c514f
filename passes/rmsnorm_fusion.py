"""RMSNorm fusion: the mean-of-squares normalisation, in any of its spellings, to one op.

    %p = pow(%x, @two)                          (or mul(%x, %x))
    %m = reduce_mean[axes=[-1], keepdim=true](%p)
    %r = rsqrt(add(%m, @eps))
    %n = mul(%x, %r)
    %y = mul(@w, %n)                            (either order; casts around %n allowed)
  ->
    %y = rms_norm[axis=-1, eps=...](%x, @w)

It takes two steps, so that a norm whose weight canonicalisation removed (a weight
of ones) fuses too: the normalisation becomes `rms_norm(%x, @ones)`, then a
constant multiply folds into its weight: `mul(@w, rms_norm(%x, @s))` ->
`rms_norm(%x, @w * @s)`. Gemma's `mul(add(@w, @one), ...)` folds as `@w + 1`.
Left alone: a reduction over other than the last axis, or without keepdim
(that is not a per-token norm), and a weight that does not broadcast along the
normalised axis only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from npuc.ir import DType, Value
from npuc.passes.rewrite import Builder, Match, RewritePass, Rule, any_of, const, op, opt, var


def _last_axis(axes: tuple[int, ...]) -> bool:
    return len(axes) == 1


def _norm(x: str = "x") -> object:
    sq = any_of(op("pow", var(x), const(value=2.0)), op("mul", var(x), var(x)))
    mean = op("reduce_mean", sq, bind="mean", keepdim=True, axes=_last_axis)
    return op("mul", var(x), op("rsqrt", op("add", mean, const("eps"))))


def _check(m: Match) -> str | None:
    x, mean = m["x"], m["mean"]
    if mean.producer is None or tuple(a % x.type.rank for a in mean.producer.attrs["axes"]) != (x.type.rank - 1,):
        return "the mean is not over the last axis"
    if m["eps"].type.numel != 1:
        return "eps is not a scalar"
    if not x.type.dtype.is_float:
        return "not a float tensor"
    return None


def _weight_check(m: Match) -> str | None:
    x, w = m["x"], m["w"]
    if w.type.rank > 1 and any(d != 1 for d in w.type.shape[:-1]) or \
            w.type.shape[-1:] not in ((x.type.shape[-1],), (1,)) and w.type.numel != 1:
        return f"weight {w.type} does not broadcast along the normalised axis only"
    return None


def _as_vector(b: Builder, w: Value, n: int, dtype: DType) -> Value:
    """A per-feature weight [n] from a broadcastable constant ([n], [1, 1, n], a scalar)."""
    if w.type.shape != (n,):
        w = b.op("reshape", [w], {"shape": (w.type.numel,)}) if w.type.numel == n else \
            b.op("expand", [b.op("reshape", [w], {"shape": (1,)})], {"shape": (n,)})
    return w if w.type.dtype == dtype else b.op("cast", [w], {"dtype": dtype})


def _unit(v: Value) -> bool:
    """The all-ones weight `_fuse` gave a norm (in memory, so cheap to check)."""
    if v.const is None or not getattr(v.const, "in_memory", False):
        return False
    return bool((v.const.load() == 1).all())


def _fuse(b: Builder, m: Match) -> Value:
    """normalise(x) alone: a norm with unit weight (the weight multiply comes next, or was a no-op)."""
    x = m["x"]
    ones = b.const(f"ones_{x.type.shape[-1]}", torch.ones(x.type.shape[-1], dtype=x.type.dtype.torch))
    eps = float(m.data("eps").reshape(-1)[0])
    return b.op("rms_norm", [x, ones], {"axis": x.type.rank - 1, "eps": eps})


def _fold_weight(b: Builder, m: Match, plus_one: bool = False) -> Value:
    """w * rms_norm(x, s) -> rms_norm(x, w * s) (s is the unit weight the first rule gave it)."""
    x, norm, root = m["x"], m.node("norm"), m.matched[0].outputs[0]
    w = m["w"]
    if plus_one:
        w = b.op("add", [w, m["one"]], name=f"{w.name}_plus_one")
    w = _as_vector(b, w, x.type.shape[-1], x.type.dtype)
    if not _unit(norm.inputs[1]):
        w = b.op("mul", [w, norm.inputs[1]], name=f"{w.name}_scale")
    y = b.op("rms_norm", [x, w], dict(norm.attrs))
    return y if y.type.dtype == root.type.dtype else b.op("cast", [y], {"dtype": root.type.dtype})


def _norm_weighted(m: Match) -> str | None:
    return _weight_check(m) or (None if m.node("norm").outputs[0].type.dtype == m["x"].type.dtype else "cast")


@dataclass(frozen=True)
class RMSNormFusion(RewritePass):
    name = "rmsnorm-fusion"

    def rules(self) -> Sequence[Rule]:
        normed = op("rms_norm", var("x"), const(), bind="norm")
        return [
            Rule("rmsnorm", _norm(), _fuse, _check),
            Rule("rmsnorm-weight-gemma", op("mul", op("add", var("w", lambda v: v.is_const), const("one", 1.0)),
                                            opt("cast", normed)),
                 lambda b, m: _fold_weight(b, m, plus_one=True), _weight_check),
            Rule("rmsnorm-weight", op("mul", opt("cast", var("w", lambda v: v.is_const)), opt("cast", normed)),
                 _fold_weight, _weight_check),
        ]
