"""SDPA -> FusedAttention: every spelling of attention becomes one `fused_attention`.

Sources: `sdpa` (torch's `scaled_dot_product_attention`, ONNX `Attention`), and the
decomposed form exporters write at opset 18:

    %kt = transpose[perm=[0,1,3,2]](%k)        (or reshape -> transpose -> reshape)
    %s  = matmul(mul(%q, @c1), mul(%kt, @c2))   (scale on the scores, split as sqrt on q and k, or absent)
    %sm = softmax[axis=-1](add(%s, @mask))      (additive mask, where(%mask, %s, -inf), or none)
    %p  = where(is_nan(%sm), @zero, %sm)        (the NaN guard, optional)
    %y  = matmul(%p, %v)
  ->
    %y  = fused_attention[scale=c1*c2, causal=...](%q, %k, %v [, %mask])

GQA: keys and values repeated by `repeat_kv` (reshape -> expand -> reshape) are read
from before the repeat; the op broadcasts heads itself. A constant mask equal to the
causal mask becomes `causal=true` and disappears. q/k and v head dims may differ (MLA).

Left alone: a softmax over other than the last axis, a mask whose shape does not
broadcast to [batch, heads, q, k] (it then stays an explicit operand only if it
does), scores scaled by a non-scalar, and operands that are not 4-D.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from npuc.ir import DType, Value, get_op
from npuc.ir.ops import ShapeError, broadcast
from npuc.passes.rewrite import Builder, Match, RewritePass, Rule, any_of, const, op, opt, var


def _scalar(v: Value) -> bool:
    return v.is_const and v.type.numel == 1


def repeat_source(v: Value) -> Value | None:
    """The [b, hkv, s, d] tensor that `repeat_kv` repeated into `v`, if it was.

    `v` is the repeat's final reshape [b, hkv*n, s, d], or its expand [b, hkv, n, s, d]
    when an exporter merged that reshape into the next one."""
    final = None
    if v.producer is not None and v.producer.op == "reshape" and v.type.rank == 4:
        final, v = v, v.producer.inputs[0]
    e = v.producer
    if e is None or e.op != "expand" or v.type.rank != 5:
        return None
    r1 = e.inputs[0].producer
    if r1 is None or r1.op != "reshape" or r1.inputs[0].type.rank != 4:
        return None
    base = r1.inputs[0]
    b, h, s, d = base.type.shape
    n = v.type.shape[2]
    if r1.outputs[0].type.shape != (b, h, 1, s, d) or v.type.shape != (b, h, n, s, d):
        return None
    if final is not None and final.type.shape != (b, h * n, s, d):
        return None  # the heads were regrouped some other way: not a repeat
    return base


def strip_repeat_kv(v: Value) -> Value:
    base = repeat_source(v)
    return base if base is not None and v.type.rank == 4 else v


def hides_nothing(mask: Value) -> bool:
    """Whether a constant mask (in memory: a weight is never read to match) masks no key:
    what a one-token trace folds its causal mask to."""
    if mask.const is None or not getattr(mask.const, "in_memory", False):
        return False
    t = mask.const.load()
    return bool(t.all()) if t.dtype == torch.bool else bool((t == 0).all())


def causal_mask(mask: Value, q_len: int, k_len: int) -> bool:
    """Whether a constant mask is exactly the (top-left aligned) causal mask."""
    if mask.const is None or mask.type.rank < 2 or mask.type.shape[-2:] != (q_len, k_len):
        return False
    if any(d != 1 for d in mask.type.shape[:-2]) and mask.type.numel > (1 << 22):
        return False
    t = mask.const.load()
    allowed = torch.ones(q_len, k_len, dtype=torch.bool).tril()
    if t.dtype == torch.bool:
        return bool((t == allowed).all())
    t = t.double()
    return bool((t[..., allowed] == 0).all() and (t[..., ~allowed] <= -1e4).all())


def _kv(q: Value, k: Value, v: Value) -> tuple[Value, Value] | str:
    """k and v as fused_attention takes them: repeat_kv undone on both where that leaves them
    the same heads (grouped-query attention), else as the product saw them (a model that
    builds v's heads some other way, DiffLlama's, keeps its repeated k); or why they do not fit."""
    ks, vs = strip_repeat_kv(k), strip_repeat_kv(v)
    if ks.type.rank == vs.type.rank == 4 and ks.type.shape[1] != vs.type.shape[1]:
        ks, vs = k, v
    try:
        get_op("fused_attention").infer_types([q.type, ks.type, vs.type], {"scale": 1.0})
    except ShapeError as e:
        return f"q, k and v do not fit one attention: {e}"
    return ks, vs


def _build(b: Builder, q: Value, k: Value, v: Value, mask: Value | None, scale: float,
           causal: bool = False) -> Value:
    kv = _kv(q, k, v)  # the checks refused what does not fit, so this is the fitting pair
    k, v = kv if not isinstance(kv, str) else (strip_repeat_kv(k), strip_repeat_kv(v))
    mask_is_causal = mask is not None and causal_mask(mask, q.type.shape[2], k.type.shape[2])
    ins = [q, k, v] + ([mask] if mask is not None and not mask_is_causal else [])
    return b.op("fused_attention", ins, {"scale": scale, "causal": causal or mask_is_causal})


def _mask_ok(m: Match, q: Value, k: Value) -> str | None:
    mask = m.values.get("mask")
    if q.type.rank != 4 or k.type.rank != 4:
        return "attention operands are not 4-D [batch, heads, seq, dim]"
    if mask is not None:
        try:
            if broadcast(mask.type.shape, (q.type.shape[0], q.type.shape[1], q.type.shape[2], k.type.shape[2])) \
                    != (q.type.shape[0], q.type.shape[1], q.type.shape[2], k.type.shape[2]):
                return f"mask {mask.type} broadcasts the scores to another shape"
        except ShapeError:
            return f"mask {mask.type} does not broadcast to the scores"
    return None


# -- from sdpa ------------------------------------------------------------------------------

def _sdpa_check(m: Match) -> str | None:
    bad = _mask_ok(m, m["q"], m["k"])
    if bad is None and m["q"].type.rank == 4:
        kv = _kv(m["q"], m["k"], m["v"])
        bad = kv if isinstance(kv, str) else None
    return bad


def _sdpa_rewrite(b: Builder, m: Match) -> Value:
    q = m["q"]
    scale = m.node("att").attrs.get("scale")
    if scale is None:
        scale = 1.0 / math.sqrt(q.type.shape[-1])
    return _build(b, q, m["k"], m["v"], m.values.get("mask"), float(scale), bool(m.node("att").attrs.get("causal")))


# -- from the decomposed form ---------------------------------------------------------------

def _swap_last(perm: tuple[int, ...]) -> bool:
    return len(perm) == 4 and tuple(perm) == (0, 1, 3, 2)


def _kt(k: str) -> object:
    """k transposed over its last two axes: directly, or folded through a 3-D view."""
    direct = op("transpose", var(k), perm=_swap_last)
    via_3d = op("reshape", op("transpose", op("reshape", var(k)), perm=(0, 2, 1)), bind="kt3")
    return any_of(direct, via_3d)


def _scaled(inner: object, name: str) -> object:
    return any_of(op("mul", inner, var(name, _scalar)), op("div", inner, var(name + "_div", _scalar)), inner)


def _decomposed_pattern() -> object:
    scores = op("matmul", _scaled(var("q"), "cq"), _scaled(_kt("k"), "ck"), bind="qk")
    scaled = _scaled(scores, "cs")
    ninf = const(value=float("-inf"))
    masked = any_of(op("add", scaled, var("mask")),
                    op("where", var("mask", lambda v: v.type.dtype == DType.bool), scaled, ninf), scaled)
    sm = op("softmax", masked, bind="sm", axis=lambda a: a in (3, -1))
    guarded = any_of(op("where", op("is_nan", sm), const(value=0.0), sm), sm)
    return op("matmul", opt("cast", guarded), var("v"))


def _key(b: Builder | None, m: Match) -> Value | str:
    """k as [b, h, s, d] (or from before its repeat_kv), however the exporter viewed it for the transpose."""
    k = m["k"]
    if "kt3" not in m.values:
        return k
    bb, h, d, s = m["kt3"].type.shape if m["kt3"].type.rank == 4 else (0, 0, 0, 0)
    transpose = m["kt3"].producer.inputs[0].producer if m["kt3"].producer else None
    if transpose is None:
        return "no key transpose"
    inner = transpose.inputs[0]
    if m["kt3"].type.rank != 4 or inner.type.shape != (bb * h, s, d):
        return "the 3-D key transpose does not swap the last two axes"
    if k.type.numel != bb * h * s * d:
        return "the key view does not hold [batch, heads, seq, dim]"
    base = repeat_source(k)
    if base is not None and base.type.shape[0] == bb and base.type.shape[2:] == (s, d) and \
            base.type.shape[1] * (k.type.shape[2] if k.type.rank == 5 else h // base.type.shape[1]) == h:
        return base
    if b is None:
        return k
    return k if k.type.shape == (bb, h, s, d) else b.op("reshape", [k], {"shape": (bb, h, s, d)}, name=f"{k.name}_4d")


def _decomposed_check(m: Match) -> str | None:
    q = m["q"]
    k = _key(None, m)
    if isinstance(k, str):
        return k
    mask = m.values.get("mask")
    if q.type.rank != 4:
        return "attention operands are not 4-D [batch, heads, seq, dim]"
    kv = _kv(q, k, m["v"]) if k.type.rank == 4 else None  # a 3-D key is viewed 4-D only when built
    if isinstance(kv, str):
        return kv
    scores = m["qk"].type.shape
    if mask is not None:
        try:
            if broadcast(mask.type.shape, scores) != scores:
                return f"mask {mask.type} broadcasts the scores to another shape"
        except ShapeError:
            return f"mask {mask.type} does not broadcast to the scores"
    return None


def _decomposed_rewrite(b: Builder, m: Match) -> Value:
    scale = 1.0
    for name in ("cq", "ck", "cs"):
        if name in m.values:
            scale *= float(m.data(name).reshape(-1)[0])
        if name + "_div" in m.values:
            scale /= float(m.data(name + "_div").reshape(-1)[0])
    k = _key(b, m)
    assert not isinstance(k, str), k
    y = _build(b, m["q"], k, m["v"], m.values.get("mask"), scale)
    root = m.matched[0].outputs[0]
    return y if y.type.dtype == root.type.dtype else b.op("cast", [y], {"dtype": root.type.dtype})


@dataclass(frozen=True)
class AttentionFusion(RewritePass):
    name = "attention-fusion"

    def rules(self) -> Sequence[Rule]:
        sdpa = any_of(op("sdpa", var("q"), var("k"), var("v"), var("mask"), bind="att"),
                      op("sdpa", var("q"), var("k"), var("v"), bind="att"))
        return [
            Rule("sdpa-to-fused-attention", sdpa, _sdpa_rewrite, _sdpa_check),
            Rule("decomposed-attention", _decomposed_pattern(), _decomposed_rewrite, _decomposed_check),
        ]
